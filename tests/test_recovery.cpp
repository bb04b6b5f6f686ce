// Position recovery from tensors (SPEC 5.5): exact below the lowest frequency's period,
// ambiguous beyond it, and keys of another rope named as such.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "reference/rope.h"
#include "tools/harness/scenario/generator.h"
#include "tools/harness/check/recovery.h"

using namespace kvcheck;

namespace {

std::vector<float> raw_key(int d, int uid) {
  std::vector<float> k(static_cast<std::size_t>(d));
  for (int i = 0; i < d; ++i) k[i] = generated_value(99, 0, static_cast<std::uint64_t>(uid), Tensor::k, 0, i);
  return k;
}

// The key a float32 cache would store: rotated in double, rounded to float.
std::vector<float> stored_key(const std::vector<float>& raw, double position, const Rope& rope) {
  const auto r = reference::rotate(std::vector<double>(raw.begin(), raw.end()), position, rope);
  return std::vector<float>(r.begin(), r.end());
}

Rope rope_of(RopeLayout layout, double theta = 10000.0) {
  Rope r;
  r.layout = layout;
  r.theta = theta;
  return r;
}

}  // namespace

TEST(Recovery, ExactBelowThePeriodOnBothLayouts) {
  const int d = 16;
  for (RopeLayout layout : {RopeLayout::half, RopeLayout::interleaved}) {
    const Rope rope = rope_of(layout);
    const double period = lowest_frequency_period(d, rope);  // about 19869 for theta 1e4, D 16
    ASSERT_NEAR(period, 2 * M_PI * std::pow(10000.0, 14.0 / 16), 1e-6);
    int uid = 0;
    for (std::int64_t p : {0, 1, 2, 7, 63, 64, 1000, 4095, 12345, 19000}) {
      const auto raw = raw_key(d, uid++);
      const auto got = recover_position(raw.data(), stored_key(raw, static_cast<double>(p), rope).data(), d, rope);
      EXPECT_EQ(got.status, RecoveredPosition::Status::exact) << p;
      EXPECT_EQ(got.position, p) << "layout " << to_string(layout);
    }
  }
}

TEST(Recovery, AmbiguousBeyondThePeriodUpTo100000) {
  const int d = 16;
  const Rope rope = rope_of(RopeLayout::half);
  int uid = 100;
  for (std::int64_t p : {20000, 50000, 77777, 100000}) {
    const auto raw = raw_key(d, uid++);
    const auto got =
        recover_position(raw.data(), stored_key(raw, static_cast<double>(p), rope).data(), d, rope, 200000);
    EXPECT_EQ(got.status, RecoveredPosition::Status::ambiguous) << p;
    EXPECT_EQ(got.position, p);  // the candidate it found is the true one
  }
}

TEST(Recovery, SmallHeadDimHasAShortPeriod) {
  // D = 2: one pair turning one radian per position, so only 0..6 are unique.
  const Rope rope = rope_of(RopeLayout::half);
  const std::vector<float> raw = {0.6f, -0.8f};
  EXPECT_EQ(recover_position(raw.data(), stored_key(raw, 5, rope).data(), 2, rope, 6).position, 5);
  EXPECT_EQ(recover_position(raw.data(), stored_key(raw, 5, rope).data(), 2, rope, 6).status,
            RecoveredPosition::Status::exact);
  // 9 is beyond the period; and with room for more turns, 5 is no longer alone either
  // (710 = 113 turns is within a thousandth of a radian of a whole number of turns).
  EXPECT_EQ(recover_position(raw.data(), stored_key(raw, 9, rope).data(), 2, rope, 100).status,
            RecoveredPosition::Status::ambiguous);
  const auto far = recover_position(raw.data(), stored_key(raw, 710, rope).data(), 2, rope, 1000);
  EXPECT_EQ(far.status, RecoveredPosition::Status::ambiguous);
  EXPECT_EQ(far.position, 0);  // the smallest position that fits
}

TEST(Recovery, NamesTheLayoutThatFits) {
  const int d = 8;
  const auto raw = raw_key(d, 7);
  const auto stored = stored_key(raw, 37, rope_of(RopeLayout::interleaved));
  const auto got = recover_position(raw.data(), stored.data(), d, rope_of(RopeLayout::half));
  EXPECT_EQ(got.status, RecoveredPosition::Status::not_rotation);
  EXPECT_EQ(got.fits.to_string(), "layout interleaved at position 37");
}

TEST(Recovery, NamesTheThetaThatFits) {
  const int d = 16;
  const auto raw = raw_key(d, 8);
  const auto stored = stored_key(raw, 300, rope_of(RopeLayout::half, 500000.0));
  const auto got = recover_position(raw.data(), stored.data(), d, rope_of(RopeLayout::half));
  EXPECT_EQ(got.status, RecoveredPosition::Status::not_rotation);
  EXPECT_EQ(got.fits.to_string(), "theta 500000 at position 300");
}

TEST(Recovery, NamesALinearScalingThatFits) {
  const int d = 16;
  const auto raw = raw_key(d, 9);
  Rope scaled = rope_of(RopeLayout::half);
  scaled.scaling = RopeScaling::linear;
  scaled.factor = 4.0;
  // 801 / 4 is no integer, so no position of the unscaled rope explains the key (802 = 4
  // x 200.5 would not either; 800 would, as position 200: the two ropes agree there).
  const auto stored = stored_key(raw, 801, scaled);
  const auto got = recover_position(raw.data(), stored.data(), d, rope_of(RopeLayout::half));
  EXPECT_EQ(got.fits.to_string(), "linear scaling 4 at position 801");
}

TEST(Recovery, CorruptedKeyIsNoRotation) {
  const int d = 8;
  const auto raw = raw_key(d, 10);
  auto stored = stored_key(raw, 12, rope_of(RopeLayout::half));
  stored[3] += 0.25f;  // one element changed: the pair's length changes
  const auto got = recover_position(raw.data(), stored.data(), d, rope_of(RopeLayout::half));
  EXPECT_EQ(got.status, RecoveredPosition::Status::not_rotation);
  EXPECT_EQ(got.fits.to_string(), "");
  EXPECT_EQ(describe(got), "not a rotation");
}

TEST(Recovery, FloatAnglesOfAnEngineStillFit) {
  // An engine that computes p * inv_freq in float32 (as Hugging Face does) rotates by a
  // slightly different angle; positions up to the scenario's longest row still come back.
  const int d = 128;
  Rope rope = rope_of(RopeLayout::half);
  for (std::int64_t p : {0, 1, 4095, 8191, 65535}) {
    std::vector<float> raw = raw_key(d, static_cast<int>(p % 97));
    for (float& x : raw) x *= 10.0f;  // long pairs
    std::vector<float> stored(raw);
    for (int i = 0; i < d / 2; ++i) {
      const float angle = static_cast<float>(p) * static_cast<float>(std::pow(10000.0, -2.0 * i / d));
      const float c = std::cos(angle), s = std::sin(angle);
      stored[i] = raw[i] * c - raw[i + d / 2] * s;
      stored[i + d / 2] = raw[i] * s + raw[i + d / 2] * c;
    }
    const auto got = recover_position(raw.data(), stored.data(), d, rope, 65536);
    EXPECT_NE(got.status, RecoveredPosition::Status::not_rotation) << p;
    EXPECT_EQ(got.position, p);
  }
}

namespace {

// x rounded to float16's 11 significant bits (normal range: these keys stay within it).
float to_half(float x) {
  int e = 0;
  const double m = std::frexp(static_cast<double>(x), &e);
  return static_cast<float>(std::ldexp(std::round(std::ldexp(m, 11)), e - 11));
}

}  // namespace

TEST(Recovery, Float16KeysAtLlamaShapeUpTo100000) {
  // D = 128, theta 500000 (Llama 3): the lowest frequency's period is about 2.6 million
  // positions, so every position below 100000 is unique; float16 storage moves each
  // element by up to 2^-11 of itself, which recovery must tolerate without a false fit.
  const int d = 128;
  const Rope rope = rope_of(RopeLayout::half, 500000.0);
  for (int uid = 0; uid < 8; ++uid)
    for (std::int64_t position : {0, 1, 7, 4095, 4096, 8193, 32767, 65536, 99999}) {
      const std::vector<float> raw = raw_key(d, uid);
      std::vector<float> stored = stored_key(raw, static_cast<double>(position), rope);
      for (float& x : stored) x = to_half(x);
      const RecoveredPosition got = recover_position(raw.data(), stored.data(), d, rope, 200000, kFloat16Roundoff);
      EXPECT_EQ(got.status, RecoveredPosition::Status::exact) << "uid " << uid << " position " << position;
      EXPECT_EQ(got.position, position) << "uid " << uid;
      // One position off is told apart: the key stored at p + 1 does not fit p.
      std::vector<float> next = stored_key(raw, static_cast<double>(position + 1), rope);
      for (float& x : next) x = to_half(x);
      EXPECT_EQ(recover_position(raw.data(), next.data(), d, rope, 200000, kFloat16Roundoff).position, position + 1);
    }
}

TEST(Recovery, Float16KeysOfAnotherLayoutAreNoRotation) {
  const int d = 128;
  const Rope rope = rope_of(RopeLayout::half, 500000.0);
  const std::vector<float> raw = raw_key(d, 3);
  std::vector<float> stored = stored_key(raw, 5000.0, rope_of(RopeLayout::interleaved, 500000.0));
  for (float& x : stored) x = to_half(x);
  const RecoveredPosition got = recover_position(raw.data(), stored.data(), d, rope, 200000, kFloat16Roundoff);
  EXPECT_EQ(got.status, RecoveredPosition::Status::not_rotation);
  EXPECT_EQ(got.fits.kind, OtherRope::Kind::layout);
}

namespace {

Rope llama31_rope() {
  Rope r;
  r.theta = 500000.0;
  r.scaling = RopeScaling::llama3;
  r.factor = 8.0;
  r.original_max_position_embeddings = 8192.0;
  return r;
}

Rope yarn_rope() {
  Rope r;
  r.theta = 150000.0;
  r.scaling = RopeScaling::yarn;
  r.factor = 32.0;
  r.original_max_position_embeddings = 4096.0;
  r.attention_factor = 0.1 * std::log(32.0) + 1.0;
  return r;
}

}  // namespace

TEST(Recovery, ThroughLlama3AndYarnMapsAndWithYarnsMagnitude) {
  const int d = 64;
  for (const Rope& rope : {llama31_rope(), yarn_rope()})
    for (std::int64_t p : {0, 1, 37, 1000}) {
      const auto raw = raw_key(d, 5);
      const RecoveredPosition r = recover_position(raw.data(), stored_key(raw, static_cast<double>(p), rope).data(), d,
                                                   rope, 4096);
      EXPECT_NE(r.status, RecoveredPosition::Status::not_rotation) << to_string(rope.scaling) << " at " << p;
      EXPECT_EQ(r.position, p) << to_string(rope.scaling);
    }
}

TEST(Recovery, PartialRotaryRecoversFromTheRotatedDimsAndNamesAWholeHeadRotation) {
  const int d = 32;
  Rope partial;
  partial.rotary_dim = 16;
  const auto raw = raw_key(d, 7);
  const RecoveredPosition r = recover_position(raw.data(), stored_key(raw, 21.0, partial).data(), d, partial, 4096);
  EXPECT_EQ(r.status, RecoveredPosition::Status::exact);
  EXPECT_EQ(r.position, 21);
  // The same key rotated over all 32 dims: not a rotation under rotary_dim 16, and named.
  const RecoveredPosition all = recover_position(raw.data(), stored_key(raw, 21.0, Rope{}).data(), d, partial, 4096);
  EXPECT_EQ(all.status, RecoveredPosition::Status::not_rotation);
  EXPECT_EQ(all.fits.kind, OtherRope::Kind::rotary_dim);
  EXPECT_EQ(all.fits.name, "rotary_dim 32 (all dims rotated)");
  EXPECT_EQ(all.fits.position, 21);
}

TEST(Recovery, Llama3ReadAsLinearIsNamedAsAFrequencyMap) {
  const int d = 64;
  Rope linear = llama31_rope();
  linear.scaling = RopeScaling::linear;
  const auto raw = raw_key(d, 9);
  const RecoveredPosition r =
      recover_position(raw.data(), stored_key(raw, 300.0, linear).data(), d, llama31_rope(), 4096);
  EXPECT_EQ(r.status, RecoveredPosition::Status::not_rotation);
  EXPECT_EQ(r.fits.kind, OtherRope::Kind::frequency_map);
  EXPECT_EQ(r.fits.name, "linear scaling 8 instead of llama3");
  EXPECT_EQ(r.fits.position, 300);
}

TEST(Recovery, AKeyWithoutYarnsMagnitudeIsNamedAsSuchEvenAtPositionZero) {
  // At position 0 every frequency map fits a rotation; only the length tells m is missing.
  const int d = 64;
  Rope unscaled = yarn_rope();
  unscaled.attention_factor = 1.0;
  const auto raw = raw_key(d, 11);
  for (std::int64_t p : {0, 12}) {
    const RecoveredPosition r =
        recover_position(raw.data(), stored_key(raw, static_cast<double>(p), unscaled).data(), d, yarn_rope(), 4096);
    EXPECT_EQ(r.status, RecoveredPosition::Status::not_rotation);
    EXPECT_EQ(r.fits.kind, OtherRope::Kind::magnitude) << "at " << p;
    EXPECT_EQ(r.fits.position, p);
  }
}

namespace {

// Gemma 3's full layers' rope (27B, 12B, 4B): theta 1,000,000, linear scaling 8.
Rope gemma3_global_rope() {
  Rope global = rope_of(RopeLayout::half, 1000000.0);
  global.scaling = RopeScaling::linear;
  global.factor = 8.0;
  return global;
}

}  // namespace

// SPEC 10.1. Gemma 3: a sliding layer (theta 10,000) whose key was rotated at position 37
// with the full layer's rope (theta 1,000,000, linear 8) fits no rotation of its own rope
// but that one: named another layer's, at 37. Under only its own rope's usual guesses the
// key would be blamed on a theta alone.
TEST(Recovery, AKeyRotatedWithAnotherLayersRopeIsNamedSo) {
  const int d = 16;
  const Rope sliding = rope_of(RopeLayout::half, 10000.0), global = gemma3_global_rope();
  const std::vector<float> raw = raw_key(d, 3), key = stored_key(raw, 37, global);
  const RecoveredPosition r = recover_position(raw.data(), key.data(), d, sliding, 1000, kFloat32Roundoff, {global});
  EXPECT_EQ(r.status, RecoveredPosition::Status::not_rotation);
  EXPECT_EQ(r.fits.kind, OtherRope::Kind::other_layer);
  EXPECT_EQ(r.fits.position, 37);
  EXPECT_NE(recover_position(raw.data(), key.data(), d, sliding, 1000).fits.kind, OtherRope::Kind::other_layer);
}

// llama.cpp issue 12357's keys: a sliding layer's key written at 10 with its own rope, then
// shifted by -4 with the global layer's. Expected at 6, it is no rotation under either rope
// alone; the composition is found and named, with the write and the shift. A key at the
// right position is not touched, and one rotated at another position under its own rope
// is no such composition.
TEST(Recovery, AKeyShiftedWithAnotherLayersRopeIsNamedSo) {
  const int d = 16;
  const Rope sliding = rope_of(RopeLayout::half, 10000.0), global = gemma3_global_rope();
  const std::vector<float> raw = raw_key(d, 7);
  const std::vector<double> written =
      reference::rotate(std::vector<double>(raw.begin(), raw.end()), 10.0, sliding);
  const std::vector<double> shifted = reference::rotate(written, -4.0, global);
  const std::vector<float> key(shifted.begin(), shifted.end());
  const RecoveredPosition r = recover_position(raw.data(), key.data(), d, sliding, 1000, kFloat32Roundoff, {global});
  ASSERT_EQ(r.status, RecoveredPosition::Status::not_rotation);
  EXPECT_EQ(r.fits.kind, OtherRope::Kind::none);  // neither rope alone
  const OtherRope fit = recover_shift_with_other_rope(raw.data(), key.data(), d, sliding, 6, {global}, 1000, 1e-3);
  EXPECT_EQ(fit.kind, OtherRope::Kind::other_layer);
  EXPECT_EQ(fit.name, "a shift of -4 under another layer's rope (theta 1e+06, linear) after its write at 10 under its own");
  const std::vector<float> right = stored_key(raw, 6, sliding), early = stored_key(raw, 5, sliding);
  EXPECT_EQ(recover_shift_with_other_rope(raw.data(), right.data(), d, sliding, 6, {global}, 1000, 1e-3).kind,
            OtherRope::Kind::none);
  EXPECT_EQ(recover_shift_with_other_rope(raw.data(), early.data(), d, sliding, 6, {global}, 1000, 1e-3).kind,
            OtherRope::Kind::none);
  EXPECT_EQ(recover_shift_with_other_rope(raw.data(), key.data(), d, sliding, 6, {}, 1000, 1e-3).kind, OtherRope::Kind::none);
}

// A NoPE layer: its raw key fits (exact, position 0); a rotated one fits only a RoPE
// layer's rope, named "NoPE layer rotated".
TEST(Recovery, ANoPEKeyIsItsRawKeyAndARotatedOneIsNamed) {
  const int d = 16;
  Rope nope;
  nope.nope = true;
  const Rope rope = rope_of(RopeLayout::half, 500000.0);
  const std::vector<float> raw = raw_key(d, 5);
  const RecoveredPosition plain = recover_position(raw.data(), raw.data(), d, nope, 1000, kFloat32Roundoff, {rope});
  EXPECT_EQ(plain.status, RecoveredPosition::Status::exact);
  const std::vector<float> turned = stored_key(raw, 12, rope);
  const RecoveredPosition r = recover_position(raw.data(), turned.data(), d, nope, 1000, kFloat32Roundoff, {rope});
  EXPECT_EQ(r.status, RecoveredPosition::Status::not_rotation);
  EXPECT_EQ(r.fits.kind, OtherRope::Kind::nope_rotated);
  EXPECT_EQ(r.fits.position, 12);
  // And rotating nothing is what the reference does for it, at any position.
  EXPECT_EQ(reference::rotate(std::vector<double>(raw.begin(), raw.end()), 12.0, nope),
            std::vector<double>(raw.begin(), raw.end()));
}
