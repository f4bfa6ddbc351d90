// Learning-rate schedules against values worked out by hand.
#include <doctest/doctest.h>

#include <cmath>

#include "megatrain/optim/lr_schedule.hpp"

using namespace megatrain;

TEST_CASE("constant schedule: the same rate at every step") {
  const LrSchedule s{LrSchedule::Kind::constant, 3e-4, 0, 0, 0.0};
  s.validate();
  for (const std::int64_t t : {1, 2, 17, 1000000}) CHECK(s.at(t) == 3e-4);
}

TEST_CASE("warm-up then cosine decay to the floor") {
  // lr 1, 4 warm-up steps, floor 0.1 reached at step 12.
  const LrSchedule s{LrSchedule::Kind::warmup_cosine, 1.0, 4, 12, 0.1};
  s.validate();
  CHECK(s.at(1) == doctest::Approx(0.25));  // linear warm-up: t / 4
  CHECK(s.at(2) == doctest::Approx(0.5));
  CHECK(s.at(4) == doctest::Approx(1.0));   // the peak
  // p = 1/8: 0.1 + 0.9 * (1 + cos(pi / 8)) / 2 = 0.1 + 0.45 * 1.9238795...
  CHECK(s.at(5) == doctest::Approx(0.9657457896));
  CHECK(s.at(8) == doctest::Approx(0.55));  // p = 1/2: half way between the peak and the floor
  CHECK(s.at(11) == doctest::Approx(0.1 + 0.45 * (1 - std::cos(3.14159265358979 / 8))));
  CHECK(s.at(12) == doctest::Approx(0.1));  // the floor, and after it
  CHECK(s.at(500) == 0.1);
  for (std::int64_t t = 5; t < 12; ++t) CHECK(s.at(t + 1) < s.at(t));  // strictly decaying

  const LrSchedule no_warmup{LrSchedule::Kind::warmup_cosine, 2.0, 0, 4, 0.0};
  CHECK(no_warmup.at(1) == doctest::Approx(1.0 + std::cos(3.14159265358979 / 4)));  // p = 1/4
  CHECK(no_warmup.at(2) == doctest::Approx(1.0));
}

TEST_CASE("warm-up then linear decay to the floor") {
  // lr 2, 2 warm-up steps, floor 0.5 reached at step 8: (2 - 0.5) / 6 = 0.25 less per step.
  const LrSchedule s{LrSchedule::Kind::warmup_linear, 2.0, 2, 8, 0.5};
  s.validate();
  CHECK(s.at(1) == doctest::Approx(1.0));
  CHECK(s.at(2) == doctest::Approx(2.0));
  for (std::int64_t t = 3; t <= 8; ++t) CHECK(s.at(t) == doctest::Approx(2.0 - 0.25 * static_cast<double>(t - 2)));
  CHECK(s.at(9) == 0.5);
  // to zero, no warm-up: 3 steps of 1/3 each
  const LrSchedule to_zero{LrSchedule::Kind::warmup_linear, 3e-5, 0, 3, 0.0};
  CHECK(to_zero.at(1) == doctest::Approx(2e-5));
  CHECK(to_zero.at(2) == doctest::Approx(1e-5));
  CHECK(to_zero.at(3) == 0.0);
}

TEST_CASE("constant after a warm-up; a constant schedule's length and floor play no part") {
  const LrSchedule s{LrSchedule::Kind::constant, 0.8, 4, 0, 0.0};
  s.validate();
  CHECK(s.at(1) == doctest::Approx(0.2));
  CHECK(s.at(3) == doctest::Approx(0.6));
  for (const std::int64_t t : {4, 5, 999}) CHECK(s.at(t) == 0.8);
}

TEST_CASE("schedule kinds by name (as train states record them)") {
  for (auto k : {LrSchedule::Kind::constant, LrSchedule::Kind::warmup_cosine, LrSchedule::Kind::warmup_linear})
    CHECK(LrSchedule::kind_named(LrSchedule::name(k), "test") == k);
  CHECK_THROWS_WITH_AS(LrSchedule::kind_named("cosine", "train_state.json"),
                       doctest::Contains("train_state.json: schedule kind 'cosine' is unknown"), Error);
}

TEST_CASE("bad schedules are refused") {
  CHECK_THROWS_WITH_AS((LrSchedule{LrSchedule::Kind::warmup_linear, 1.0, 5, 3, 0.0}.validate()),
                       doctest::Contains("warmup_linear schedule: total steps 3 must exceed warm-up steps 5"), Error);
  CHECK_THROWS_WITH_AS((LrSchedule{LrSchedule::Kind::warmup_cosine, 1.0, 10, 10, 0.0}.validate()),
                       doctest::Contains("must exceed warm-up steps"), Error);
  CHECK_THROWS_WITH_AS((LrSchedule{LrSchedule::Kind::constant, 1.0, 0, 0, 2.0}.validate()), doctest::Contains("min_lr"), Error);
  CHECK_THROWS_WITH_AS((LrSchedule{LrSchedule::Kind::constant, -1.0, 0, 0, 0.0}.validate()), doctest::Contains("learning rate"),
                       Error);
  CHECK_THROWS_WITH_AS(LrSchedule{}.at(0), doctest::Contains("steps count from 1"), Error);
}
