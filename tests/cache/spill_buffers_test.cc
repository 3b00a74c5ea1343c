// SpillBuffers (cache/spill_buffers.h): buffers come back and serve the next Take of a fitting
// size, small ones and those beyond the idle bound are freed, and Share gives a copy's buffers
// back when its last reference goes.
#include "cache/spill_buffers.h"

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace kvs {
namespace {

constexpr size_t kMiB = size_t{1} << 20;

class SpillBuffersTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // The process-wide instance: start each test with no idle buffers.
    SpillBuffers::Default().SetMaxIdleBytes(0);
    SpillBuffers::Default().SetMaxIdleBytes(8 * kMiB);
  }
  SpillBuffers& buffers() { return SpillBuffers::Default(); }
};

TEST_F(SpillBuffersTest, ABufferComesBackForAFittingSize) {
  std::string first = buffers().Take(2 * kMiB);
  ASSERT_EQ(first.size(), 2 * kMiB);
  first[0] = 'x';
  const char* address = first.data();
  buffers().Give(std::move(first));
  EXPECT_GE(buffers().idle_bytes(), 2 * kMiB);
  // Too large for it: a new buffer.
  std::string bigger = buffers().Take(3 * kMiB);
  EXPECT_NE(bigger.data(), address);
  EXPECT_EQ(bigger.size(), 3 * kMiB);
  // Fits (at most a quarter smaller than its capacity): the same buffer, resized.
  std::string again = buffers().Take(1792 << 10);
  EXPECT_EQ(again.data(), address);
  EXPECT_EQ(again.size(), size_t{1792} << 10);
  EXPECT_EQ(buffers().idle_bytes(), 0u);
  // Much smaller than the idle buffer: not wasted on it.
  buffers().Give(std::move(again));
  std::string small = buffers().Take(1536 << 10);
  EXPECT_NE(small.data(), address);
  EXPECT_GE(buffers().idle_bytes(), 2 * kMiB);
}

TEST_F(SpillBuffersTest, SmallBuffersAndBuffersBeyondTheBoundAreFreed) {
  buffers().Give(std::string(1000, 'a'));
  EXPECT_EQ(buffers().idle_bytes(), 0u);
  for (int i = 0; i < 5; ++i) buffers().Give(std::string(2 * kMiB, 'b'));
  EXPECT_LE(buffers().idle_bytes(), 8 * kMiB);
  EXPECT_GE(buffers().idle_bytes(), 6 * kMiB);
  buffers().SetMaxIdleBytes(3 * kMiB);
  EXPECT_LE(buffers().idle_bytes(), 3 * kMiB);
}

TEST_F(SpillBuffersTest, SharedCopiesGiveTheirLayersBackWhenTheLastReferenceGoes) {
  SpilledSequence data;
  data.meta = "meta";
  data.layers = {std::string(kMiB, 'a'), std::string(kMiB, 'b'), std::string(10, 'c')};
  std::shared_ptr<const SpilledSequence> shared = buffers().Share(std::move(data));
  std::shared_ptr<const SpilledSequence> reader = shared;
  EXPECT_EQ(shared->layers[1], std::string(kMiB, 'b'));
  shared.reset();
  EXPECT_EQ(buffers().idle_bytes(), 0u) << "a reader still holds the copy";
  reader.reset();
  EXPECT_GE(buffers().idle_bytes(), 2 * kMiB);
  EXPECT_LT(buffers().idle_bytes(), 3 * kMiB) << "the 10-byte layer is not kept";
}

TEST_F(SpillBuffersTest, ASpilledSequenceGivesItsLayersBackWhenDestroyed) {
  {
    SpilledSequence data;
    data.layers.push_back(buffers().Take(2 * kMiB));
    SpilledSequence moved = std::move(data);  // the buffer follows the move, once
    EXPECT_EQ(buffers().idle_bytes(), 0u);
  }
  EXPECT_GE(buffers().idle_bytes(), 2 * kMiB);
  // Assigning over a sequence gives the buffers it held back too.
  SpilledSequence held;
  held.layers.push_back(buffers().Take(2 * kMiB));
  EXPECT_EQ(buffers().idle_bytes(), 0u);
  held = SpilledSequence("meta", {});
  EXPECT_GE(buffers().idle_bytes(), 2 * kMiB);
}

// A pinner that records what is page-locked; every pinned buffer must be unpinned before it is
// freed (a freed range still registered with the driver leaks its pages and refuses the next
// registration of that address).
class RecordingPinner {
 public:
  SpillBuffers::Pinner Make() {
    return {[this](void* p, size_t bytes) {
              locked_[p] = bytes;
              ++pins_;
              return true;
            },
            [this](void* p) {
              EXPECT_EQ(locked_.erase(p), 1u) << "unpinned a buffer that was not pinned";
            }};
  }
  size_t locked() const { return locked_.size(); }
  int pins() const { return pins_; }

 private:
  std::map<void*, size_t> locked_;
  int pins_ = 0;
};

TEST_F(SpillBuffersTest, PinnedBuffersStayPinnedWhileRecycledAndAreUnpinnedBeforeFreed) {
  RecordingPinner pinner;
  buffers().SetPinner(pinner.Make());
  std::string big = buffers().Take(2 * kMiB);
  std::string small = buffers().Take(128 << 10);  // under kMinPinBytes: not pinned
  EXPECT_EQ(pinner.locked(), 1u);
  EXPECT_EQ(buffers().pinned_bytes(), big.capacity());
  const char* address = big.data();
  // Recycled: it comes back pinned, and is not pinned again.
  {
    SpilledSequence data;
    data.layers.push_back(std::move(big));
    data.layers.push_back(std::move(small));
  }
  std::string again = buffers().Take(2 * kMiB);
  EXPECT_EQ(again.data(), address);
  EXPECT_EQ(pinner.pins(), 1);
  // Beyond the idle bound: unpinned, then freed.
  buffers().SetMaxIdleBytes(0);
  buffers().Give(std::move(again));
  EXPECT_EQ(pinner.locked(), 0u);
  EXPECT_EQ(buffers().pinned_bytes(), 0u);
  // Idle buffers freed by a smaller bound are unpinned too.
  buffers().SetMaxIdleBytes(8 * kMiB);
  buffers().Give(buffers().Take(3 * kMiB));
  EXPECT_EQ(pinner.locked(), 1u);
  buffers().SetMaxIdleBytes(0);
  EXPECT_EQ(pinner.locked(), 0u);
  // Cleared: buffers made from now on are not pinned, and nothing reaches the old pinner.
  buffers().SetMaxIdleBytes(8 * kMiB);
  buffers().Give(buffers().Take(2 * kMiB));
  EXPECT_EQ(pinner.locked(), 1u);
  buffers().SetPinner({});
  buffers().SetMaxIdleBytes(0);  // frees the buffer the cleared pinner pinned, without a call
  buffers().SetMaxIdleBytes(8 * kMiB);
  std::string plain = buffers().Take(2 * kMiB);
  EXPECT_EQ(pinner.pins(), 3);
  EXPECT_EQ(buffers().pinned_bytes(), 0u);
}

}  // namespace
}  // namespace kvs
