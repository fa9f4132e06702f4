// The accuracy rule's pieces (docs/testing.md): within_budget and the LSE's tolerance.
#include <gtest/gtest.h>

#include <cmath>

#include "pagedattn/accuracy.h"

namespace pagedattn {
namespace {

TEST(Accuracy, WithinBudgetIsMultipleOfBaselinePlusAtol) {
  ErrorStats baseline;
  baseline.max_abs = 1e-3;
  ErrorStats got;
  const Tolerance tol{2.0, 1e-4};
  got.max_abs = 2.1e-3 - 1e-9;
  EXPECT_TRUE(within_budget(got, baseline, tol));
  got.max_abs = 2.1e-3 + 1e-9;
  EXPECT_FALSE(within_budget(got, baseline, tol));
  got.max_abs = 0;
  got.mismatched_nonfinite = 1;
  EXPECT_FALSE(within_budget(got, baseline, tol));
}

TEST(Accuracy, LseToleranceIsEightFloat32UlpsOfTheLargestLse) {
  // Small LSEs keep the flat float32 atol.
  EXPECT_EQ(lse_tolerance(0.0).atol, 1e-5);
  EXPECT_EQ(lse_tolerance(10.0).atol, 1e-5);
  EXPECT_EQ(lse_tolerance(10.0).multiple, 2.0);
  // At |LSE| 70 a float32 unit in the last place is 2^-17 (7.6e-6): eight of them.
  EXPECT_DOUBLE_EQ(lse_tolerance(70.0).atol, 8.0 * std::ldexp(1.0, -23) * 70.0);
  // The case that a flat 1e-5 failed: 4 units off at |LSE| 70 against a baseline of 1 unit.
  ErrorStats got, baseline;
  got.max_abs = 2.9e-5;
  baseline.max_abs = 7.8e-6;
  EXPECT_FALSE(within_budget(got, baseline, Tolerance{2.0, 1e-5}));
  EXPECT_TRUE(within_budget(got, baseline, lse_tolerance(70.0)));
  // Still not loose: 1% of a unit-sized LSE fails.
  got.max_abs = 1e-2;
  baseline.max_abs = 1e-6;
  EXPECT_FALSE(within_budget(got, baseline, lse_tolerance(1.0)));
}

}  // namespace
}  // namespace pagedattn
