"""benchmarks.bench_links without a GPU: it exits 0 and says why when there is nothing to measure, and its
measurement logic runs on a stand-in for cuda.bindings.runtime (R devices whose copies take bytes / bandwidth):
every ordered pair, the all-pairs round and the local copy get a row at the stand-in's bandwidth, every call is made
on the device that owns its stream and events, and everything allocated is freed."""

import enum
import json
import pathlib
import subprocess
import sys
import types

import pytest

from benchmarks import bench_links

ROOT = pathlib.Path(__file__).resolve().parents[1]

PEER_GBPS, LOCAL_GBPS = 100.0, 1000.0


class FakeRuntime:
  """The calls of cuda.bindings.runtime that bench_links makes, on R pretend devices. Streams run their copies in
  order from the device's last synchronization; streams of a device overlap (no bandwidth sharing)."""

  class cudaError_t(enum.Enum):  # pylint: disable=invalid-name
    cudaSuccess = 0
    cudaErrorNoDevice = 100
    cudaErrorPeerAccessAlreadyEnabled = 704

  class cudaMemcpyKind(enum.Enum):  # pylint: disable=invalid-name
    cudaMemcpyDeviceToDevice = 3

  cudaStreamNonBlocking = 1

  def __init__(self, R):
    self.R, self.dev = R, 0
    self.sync_ms = [0.0] * R             # each device's time at its last synchronization
    self.live = {"malloc": 0, "stream": 0, "event": 0}
    self.peer_enabled = set()
    self.next_ptr = 1 << 20

  ok = (cudaError_t.cudaSuccess,)

  def _new(self, kind, **fields):
    self.live[kind] += 1
    return types.SimpleNamespace(kind=kind, device=self.dev, **fields)

  def _free(self, kind):
    self.live[kind] -= 1
    return self.ok

  def cudaGetDeviceCount(self):
    return (self.cudaError_t.cudaErrorNoDevice, None) if self.R == 0 else (self.cudaError_t.cudaSuccess, self.R)

  def cudaGetErrorString(self, err):
    return self.cudaError_t.cudaSuccess, f"fake {err.name}".encode()

  def cudaGetDeviceProperties(self, d):
    assert 0 <= d < self.R
    return self.cudaError_t.cudaSuccess, types.SimpleNamespace(name=b"Fake GPU\x00\x00")

  def cudaDriverGetVersion(self):
    return self.cudaError_t.cudaSuccess, 13000

  cudaRuntimeGetVersion = cudaDriverGetVersion

  def cudaSetDevice(self, d):
    assert 0 <= d < self.R
    self.dev = d
    return self.ok

  def cudaMalloc(self, n):
    self.live["malloc"] += 1
    self.next_ptr += n
    return self.cudaError_t.cudaSuccess, self.next_ptr - n

  def cudaMemset(self, ptr, value, n):
    del ptr, value, n
    return self.ok

  def cudaFree(self, ptr):
    del ptr
    return self._free("malloc")

  def cudaStreamCreateWithFlags(self, flags):
    assert flags == self.cudaStreamNonBlocking
    return self.cudaError_t.cudaSuccess, self._new("stream", clock=0.0)

  def cudaStreamDestroy(self, s):
    assert s.device == self.dev
    return self._free("stream")

  def cudaEventCreate(self):
    return self.cudaError_t.cudaSuccess, self._new("event", t=None)

  def cudaEventDestroy(self, e):
    del e
    return self._free("event")

  def cudaDeviceCanAccessPeer(self, a, b):
    assert a != b
    return self.cudaError_t.cudaSuccess, 1

  def cudaDeviceEnablePeerAccess(self, peer, flags):
    assert flags == 0 and peer != self.dev
    if (self.dev, peer) in self.peer_enabled:
      return (self.cudaError_t.cudaErrorPeerAccessAlreadyEnabled,)
    self.peer_enabled.add((self.dev, peer))
    return self.ok

  def _run(self, stream, ms):
    """Stream work of ms milliseconds, issued on the current device: returns when it starts."""
    assert stream.device == self.dev, "work issued on a stream of another device"
    stream.clock = max(stream.clock, self.sync_ms[stream.device]) + ms
    return self.ok

  def cudaEventRecord(self, e, stream):
    assert e.device == stream.device == self.dev, "event, stream and current device differ"
    self._run(stream, 0.0)
    e.t = stream.clock
    return self.ok

  def cudaMemcpyPeerAsync(self, dst, dst_dev, src, src_dev, n, stream):
    del dst, src
    assert src_dev == stream.device and dst_dev != src_dev and (src_dev, dst_dev) in self.peer_enabled
    return self._run(stream, n / PEER_GBPS / 1e6)

  def cudaMemcpyAsync(self, dst, src, n, kind, stream):
    del dst, src
    assert kind == self.cudaMemcpyKind.cudaMemcpyDeviceToDevice
    return self._run(stream, n / LOCAL_GBPS / 1e6)

  def cudaEventSynchronize(self, e):
    assert e.t is not None
    return self.ok

  def cudaEventElapsedTime(self, a, b):
    assert a.device == b.device, "elapsed time between events of two devices"
    return self.cudaError_t.cudaSuccess, b.t - a.t

  def cudaDeviceSynchronize(self):
    self.sync_ms[self.dev] += 1.0 + 1e3     # any later start than every stream's work so far
    return self.ok


def _run(tmp_path, R, capsys):
  out = tmp_path / "links.jsonl"
  fake = FakeRuntime(R)
  assert bench_links.main(["--mib", "4", "--reps", "3", "--out", str(out)], runtime=fake) == 0
  lines = [json.loads(x) for x in out.read_text().splitlines()]
  return fake, lines[0]["meta"], lines[1:], capsys.readouterr().out


@pytest.mark.parametrize("R", [2, 4])
def test_every_pair_all_pairs_and_local_copy(tmp_path, capsys, R):
  fake, meta, rows, text = _run(tmp_path, R, capsys)
  assert meta["devices"] == ["Fake GPU"] * R and meta["mib"] == 4
  kinds = [r["kind"] for r in rows]
  assert kinds.count("local copy") == R and kinds.count("pair") == R * (R - 1)
  assert kinds.count("all-pairs") == R and kinds.count("all-pairs total") == 1
  pairs = {(r["src"], r["dst"]) for r in rows if r["kind"] == "pair"}
  assert pairs == {(s, d) for s in range(R) for d in range(R) if s != d}
  for r in rows:
    if r["kind"] == "pair":
      assert r["peer"] == "yes" and float(r["GBps"]) == pytest.approx(PEER_GBPS, rel=1e-3), r
    elif r["kind"] == "local copy":
      assert float(r["GBps"]) == pytest.approx(LOCAL_GBPS, rel=1e-3), r
    elif r["kind"] == "all-pairs":        # copies in parallel streams of one device: x one link
      assert float(r["GBps"]) == pytest.approx((R - 1) * PEER_GBPS, rel=1e-3), r
    else:                                 # host wall time: positive, no more than the devices' sum
      assert 0 < float(r["GBps"]), r
  assert fake.live == {"malloc": 0, "stream": 0, "event": 0}
  assert f"| 0 | {LOCAL_GBPS:.1f} | " + " | ".join([f"{PEER_GBPS:.1f}"] * (R - 1)) + " |" in text   # matrix row 0
  assert {r["MiB"] for r in rows if r["kind"] == "all-pairs"} == {4 * (R - 1)}                  # MiB moved per row


def test_one_gpu_measures_the_local_copy_only(tmp_path, capsys):
  _, _, rows, text = _run(tmp_path, 1, capsys)
  assert [r["kind"] for r in rows] == ["local copy"]
  assert "fewer than 2 GPUs" in text


def test_no_device_exits_cleanly(tmp_path, capsys):
  _, _, rows, text = _run(tmp_path, 0, capsys)
  assert rows == [{"kind": "skipped", "reason": rows[0]["reason"]}] and "cudaErrorNoDevice" in rows[0]["reason"]
  assert "nothing to measure" in text


def test_failed_call_names_the_call():
  fake = FakeRuntime(2)
  fake.cudaMalloc = lambda n: (FakeRuntime.cudaError_t.cudaErrorNoDevice, None)
  with pytest.raises(RuntimeError, match=r"cudaMalloc\(8,\): cudaErrorNoDevice"):
    bench_links.Cuda(fake)("cudaMalloc", 8)


def test_script_without_gpu_exits_0(tmp_path):
  """As a process, on this machine (no GPU; cuda-python may be missing): rc 0, a 'nothing to measure' line."""
  out = tmp_path / "links.jsonl"
  p = subprocess.run([sys.executable, "-m", "benchmarks.bench_links", "--out", str(out)], cwd=ROOT,
                     capture_output=True, text=True, timeout=120, check=False)
  if "nothing to measure" not in p.stdout:
    pytest.skip(f"this machine has a GPU: {p.stdout[:200]}")
  assert p.returncode == 0, p.stderr
  assert json.loads(out.read_text().splitlines()[1])["kind"] == "skipped"
