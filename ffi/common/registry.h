// Integer handles for native objects named by the custom calls' `workspace` attribute. One registry per platform;
// each starts its handles at its own base, so a handle also says which platform's registry holds it.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>

namespace jmo {

template <typename T>
class HandleRegistry {
 public:
  explicit HandleRegistry(int64_t first_handle) : next_(first_handle) {}

  int64_t Add(std::unique_ptr<T> obj) {
    std::lock_guard<std::mutex> lock(mu_);
    const int64_t h = next_++;
    objects_[h] = std::move(obj);
    return h;
  }

  T* Find(int64_t handle) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = objects_.find(handle);
    return it == objects_.end() ? nullptr : it->second.get();
  }

  // Destroys the object outside the lock (a destructor may join threads or synchronize devices).
  bool Remove(int64_t handle) {
    std::unique_ptr<T> victim;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = objects_.find(handle);
      if (it == objects_.end()) return false;
      victim = std::move(it->second);
      objects_.erase(it);
    }
    return true;
  }

 private:
  std::mutex mu_;
  std::map<int64_t, std::unique_ptr<T>> objects_;
  int64_t next_;
};

}  // namespace jmo
