"""tools/sass_count.py's regions on a made-up SASS listing in cuobjdump's format: a setup, a tile loop holding a
k-loop of wgmma instructions, an epilogue with a branch region, a spill reload and a store, then the exit."""
from tools import sass_count

LISTING = """
        Function : _Z6kernelv
        /*0000*/                   MOV R1, c[0x0][0x28] ;                     /* 0x00000a0000017a02 */
        /*0010*/                   S2R R0, SR_TID.X ;                         /* 0x0000000000007919 */
        /*0020*/                   WARPGROUP.ARRIVE ;                         /* 0x00000000000079c5 */
        /*0030*/                   QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR8], RZ, !UPT ; /* 0x0 */
        /*0040*/                   FFMA R2, R24, R3, R2 ;                     /* 0x0 */
        /*0050*/              @!P1 BRA 0x20 ;                                 /* 0x0 */
        /*0060*/                   BSSY B0, 0xa0 ;                            /* 0x0 */
        /*0070*/                   LDL R5, [R1] ;                             /* 0x0 */
        /*0080*/               @P0 CALL.REL.NOINC 0x100 ;                     /* 0x0 */
        /*0090*/                   BSYNC B0 ;                                 /* 0x0 */
        /*00a0*/                   STG.E.128 desc[UR4][R6.64], R8 ;           /* 0x0 */
        /*00b0*/               @P2 BRA 0x20 ;                                 /* 0x0 */
        /*00c0*/                   EXIT ;                                     /* 0x0 */
"""


def test_regions_split_the_k_loop_and_the_epilogue():
  ins = sass_count.instructions(LISTING)
  assert len(ins) == 13 and ins[0] == (0, "MOV R1, c[0x0][0x28]")
  r = sass_count.regions(ins)
  assert [sass_count.opcode(t) for t in r["k-loop"]] == ["WARPGROUP", "QGMMA", "FFMA", "BRA"]
  assert [sass_count.opcode(t) for t in r["epilogue"]] == ["BSSY", "LDL", "CALL", "BSYNC", "STG", "BRA"]
  assert len(r["kernel"]) == 13
  s = sass_count.summary(r["epilogue"])
  assert s.startswith("6 instructions, 1 branch regions, 1 local (LDL/STL);"), s


def test_a_kernel_without_wgmma_has_one_region():
  ins = sass_count.instructions(LISTING.replace("QGMMA", "FMUL"))
  assert list(sass_count.regions(ins)) == ["kernel"]
  assert sass_count.opcode("@!P0 BRA 0x10") == "BRA" and sass_count.opcode("FFMA.FTZ R1, R2, R3, R4") == "FFMA"


def test_functions_splits_a_whole_cubin_listing():
  two = LISTING + LISTING.replace("_Z6kernelv", "_Z5otherv").replace("QGMMA", "FMUL")
  fns = sass_count.functions(two)
  assert list(fns) == ["_Z6kernelv", "_Z5otherv"]
  assert len(sass_count.instructions(fns["_Z6kernelv"])) == 13 and "QGMMA" not in fns["_Z5otherv"]
