"""Contiguous reservations sized by an output-length predictor (S3): the reservation, the
overflow of a request that outgrows it, the predictor's error model, and what it buys
against request_max and the oracle."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from sim.engine import run_scenario
from sim.length_predictor import predicted_output_lengths
from sim.memory import AllocatorError, ContiguousAllocator, SeqSpec
from sim.memory.contiguous import reservation_slots
from sim.scenario import PredictorConfig, ScenarioError, SchedulerConfig, scenario_from_dict
from sim.scheduler import Request, Scheduler
from sim.trace_stats import trace_stats
from workloads import TraceImportError, WorkloadError
from workloads.trace import Trace


def spec(prompt: int, final: int, predicted: int, max_len: int | None = None) -> SeqSpec:
    return SeqSpec(0, ((1, final),), prompt, final, max_len or final, predicted)


@pytest.mark.parametrize(("prompt", "final", "max_len", "predicted", "expected"), [
    (100, 300, 500, 250, 250),   # a short guess: reserved as guessed
    (100, 300, 500, 400, 400),   # a long one: as guessed too
    (100, 300, 500, 900, 500),   # never beyond what request_max reserves
    (100, 300, 500, 50, 100),    # at least the prompt
    (100, 300, 5000, 4500, 4096),  # nor beyond the model's context
])
def test_a_predicted_reservation_is_the_guess_within_bounds(prompt, final, max_len, predicted,
                                                             expected):
    assert reservation_slots(spec(prompt, final, predicted, max_len), "predicted",
                             4096) == expected


def test_a_predicted_reservation_needs_a_prediction():
    with pytest.raises(ValueError, match="needs a predicted_len"):
        reservation_slots(spec(10, 20, 0), "predicted", 4096)


def test_a_write_past_a_short_reservation_is_refused_and_changes_nothing():
    alloc = ContiguousAllocator(1000, max_model_len=4096, reserve_policy="predicted")
    assert alloc.admit(spec(100, 300, 150)) == 0
    assert alloc.allocated_slots(0) == 150
    assert alloc.append(0, 120)
    before = alloc.snapshot()
    # 30 more fit, 31 do not; max_uniform_append says the same.
    assert alloc.max_uniform_append([0], 100) == 30
    assert not alloc.append(0, 31)
    assert alloc.snapshot() == before and alloc.num_tokens(0) == 120
    # The extent will be written to its end, no further: no internal waste, 30 reserved.
    assert (before.token, before.reserved, before.internal) == (120, 30, 0)
    assert alloc.append(0, 30)
    alloc.check_invariants()
    with pytest.raises(AllocatorError, match="past its final length"):
        alloc.append(0, 200)  # the true length still bounds every write


def test_a_guess_beyond_the_pool_is_cut_to_it_so_the_request_can_still_run():
    alloc = ContiguousAllocator(400, max_model_len=4096, reserve_policy="predicted")
    long_guess = spec(100, 300, 1000, max_len=2000)
    assert alloc.can_admit_ever(long_guess)  # the true 300 tokens fit
    assert alloc.admit(long_guess) == 0 and alloc.allocated_slots(0) == 400
    assert not alloc.can_admit_ever(spec(100, 401, 150))  # the truth does not


def one_request_scheduler(output_len: int, predicted: int, *, n: int = 1, max_tokens: int = 100,
                          pool: int = 1000, overflow_to_max: bool = False,
                          ) -> tuple[Scheduler, Request]:
    trace = Trace.from_columns(arrival_s=np.zeros(1), prompt_len=np.array([30]),
                               output_len=np.array([output_len]), n=np.array([n]),
                               max_tokens=np.array([max_tokens]))
    alloc = ContiguousAllocator(pool, max_model_len=4096, reserve_policy="predicted")
    sched = Scheduler(alloc, SchedulerConfig(), debug=True, predicted_output=[predicted],
                      overflow_to_max=overflow_to_max)
    request = Request(trace, 0, 0.0)
    assert sched.add(request)
    return sched, request


def run_alone(sched: Scheduler, request: Request) -> list[int]:
    """Step until the request finishes; the extent it holds at each admission."""
    extents = []
    clock = 0.0
    while request.finished_s < 0:
        assert clock < 1000, "the request never finished"
        batch = sched.schedule(clock)
        if any(r is request for r, _, _ in batch.prefill):  # (admitted: a whole prompt)
            extents.append(sched.allocator.allocated_slots(0))
        clock += 1.0
        sched.finish_step(batch, clock)
    return extents


def test_a_request_that_outgrows_its_guess_is_seated_again_with_twice_the_guess():
    # Prompt 30, output 40, guessed 5: extents of 34 (the KV of 30 + 5 tokens: the last
    # generated token's is never written), 39 (30 + 10), 49 (30 + 20), then 69 (30 + 40),
    # which holds it. Each time it is preempted when it writes past the end, and recomputes
    # what it had: 34, 39 and 49 tokens.
    sched, request = one_request_scheduler(output_len=40, predicted=5)
    assert run_alone(sched, request) == [34, 39, 49, 69]
    assert sched.reservation_overflows == request.preemptions == 3
    assert request.recomputed_tokens == 34 + 39 + 49
    assert request.gen_sync == 40


def test_on_overflow_request_max_seats_it_again_with_its_max_tokens():
    # The same request under on_overflow: request_max: 34, then the KV of 30 + 100
    # (max_tokens), which no output outgrows. One recompute of 34 tokens instead of three.
    sched, request = one_request_scheduler(output_len=40, predicted=5, overflow_to_max=True)
    assert run_alone(sched, request) == [34, 129]
    assert sched.reservation_overflows == request.preemptions == 1
    assert request.recomputed_tokens == 34


def test_a_good_guess_never_overflows():
    sched, request = one_request_scheduler(output_len=40, predicted=40)
    assert run_alone(sched, request) == [69]  # the oracle's: the KV of 30 + 40 tokens
    assert sched.reservation_overflows == request.preemptions == 0


def test_samples_guesses_are_cut_so_that_all_their_extents_fit_the_pool():
    # Two samples of 30 + 40 in a pool of 150: a guess of 50 would reserve 80 each, which
    # never fit together; cut to 45 (75 each), both run.
    sched, request = one_request_scheduler(output_len=40, predicted=50, n=2, pool=150)
    assert request.predicted_output == 45
    run_alone(sched, request)
    assert request.finished_s > 0 and request.preemptions == 0


def trace_like(sigma: float, headroom: float = 0.0, seed: int = 0, count: int = 20_000):
    rng = np.random.default_rng(1)
    output = rng.integers(1, 500, count)
    trace = Trace.from_columns(arrival_s=np.zeros(count), prompt_len=np.full(count, 10),
                               output_len=output, max_tokens=output * 4)
    return trace, np.array(predicted_output_lengths(
        trace, PredictorConfig(sigma=sigma, headroom=headroom), seed))


def test_the_predictor_blurs_the_truth_by_its_sigma_within_max_tokens():
    trace, exact = trace_like(0.0)
    assert (exact == trace.output_len).all()  # sigma 0: a perfect predictor
    _, roomy = trace_like(0.0, headroom=0.5)
    assert (roomy == np.minimum(np.ceil(trace.output_len * 1.5), trace.max_tokens)).all()
    for sigma in (0.3, 1.0):
        _, guess = trace_like(sigma)
        assert (guess >= 1).all() and (guess <= trace.max_tokens).all()
        # Median-unbiased; the median |log error| of a normal is 0.674 sigma (the ceiling
        # and the max_tokens clip move it a little, far less than the tolerance).
        log_error = np.log(guess / trace.output_len)
        long_enough = trace.output_len >= 100
        assert abs(np.median(log_error[long_enough])) < 0.03
        assert np.median(np.abs(log_error[long_enough])) == pytest.approx(0.674 * sigma,
                                                                           rel=0.08)


def test_every_sigma_blurs_the_same_requests_the_same_way():
    # Common random numbers: the error draw depends on the seed alone, so a larger sigma
    # scales each request's error rather than drawing new ones.
    trace, small = trace_like(0.2)
    _, large = trace_like(0.8)
    long_enough = trace.output_len >= 200
    small_err = np.log(small / trace.output_len)[long_enough]
    large_err = np.log(large / trace.output_len)[long_enough]
    assert (np.sign(small_err) == np.sign(large_err))[np.abs(small_err) > 0.02].all()
    assert np.corrcoef(small_err, large_err)[0, 1] > 0.99
    _, again = trace_like(0.2)
    _, other_seed = trace_like(0.2, seed=1)
    assert (again == small).all() and (other_seed != small).any()


def scenario(*allocators: dict, **top) -> dict:
    return {
        "name": "prediction", "model": "llama-2-7b", "memory": {"kv_memory_gib": 3},
        "workload": {"arrival": {"process": "poisson", "rate": 20},
                     "prompt_len": {"dist": "lognormal", "mean": 300, "sigma": 0.8,
                                    "max": 2000},
                     "output_len": {"dist": "lognormal", "mean": 250, "sigma": 1.0,
                                    "max": 1500}},
        "systems": [system(a) for a in allocators],
        "stop": {"num_requests": 500}, **top,
    }


def system(allocator: dict) -> dict:
    """A system of ``allocator``, whose ``name`` and ``predictor`` go to the system."""
    allocator = dict(allocator)
    out = {"name": allocator.pop("name", allocator.get("reserve_policy", "paged")),
           "allocator": allocator}
    if "predictor" in allocator:
        out["predictor"] = allocator.pop("predictor")
    return out


def test_a_perfect_predictor_is_the_oracle():
    result = run_scenario(scenario_from_dict(scenario(
        {"kind": "contiguous", "reserve_policy": "oracle"},
        {"kind": "contiguous", "reserve_policy": "predicted", "predictor": {"sigma": 0}})))
    oracle, predicted = result.systems["oracle"], result.systems["predicted"]
    pd.testing.assert_frame_equal(oracle.requests, predicted.requests)
    assert predicted.summary["reservation_overflows"] == 0
    assert oracle.summary["reservation_overflows"] is None  # no predictor: shown "—"


def test_a_blurred_predictor_lands_between_request_max_and_the_oracle():
    # The seed's question with a predictor: reserving a guess beats reserving max_tokens,
    # and loses to knowing the length by the recompute of the requests that outgrow it.
    result = run_scenario(scenario_from_dict(scenario(
        {"kind": "contiguous", "reserve_policy": "request_max"},
        {"kind": "contiguous", "reserve_policy": "predicted", "predictor": {"sigma": 0.5}},
        {"kind": "contiguous", "reserve_policy": "oracle"})))
    summary = {name: run.summary for name, run in result.systems.items()}
    tput = {name: s["throughput_tok_s"] for name, s in summary.items()}
    assert tput["request_max"] < tput["predicted"] < tput["oracle"]
    predicted = summary["predicted"]
    assert predicted["reservation_overflows"] == predicted["preemptions"] > 0
    assert predicted["recomputed_tokens"] > 0
    # Over-guesses waste reservation; the oracle wastes none.
    assert predicted["internal_frac_of_allocated"] > 0.02
    assert summary["oracle"]["internal_frac_of_allocated"] == 0


def test_retrying_with_max_tokens_overflows_once_at_most():
    # A poor predictor: doubling may overflow a request several times; reserving its
    # max_tokens after the first miss never twice, at the price of larger extents.
    result = run_scenario(scenario_from_dict(scenario(
        {"kind": "contiguous", "reserve_policy": "predicted", "name": "double",
         "predictor": {"sigma": 1.5}},
        {"kind": "contiguous", "reserve_policy": "predicted", "name": "to-max",
         "on_overflow": "request_max", "predictor": {"sigma": 1.5}})))
    double, to_max = result.systems["double"], result.systems["to-max"]
    assert double.requests["preemptions"].max() >= 2
    assert to_max.requests["preemptions"].max() == 1
    assert 0 < to_max.summary["reservation_overflows"] < double.summary["reservation_overflows"]
    with pytest.raises(ScenarioError, match="on_overflow applies to reserve_policy: "
                       "predicted, not oracle") as err:
        scenario_from_dict(scenario({"kind": "contiguous", "reserve_policy": "oracle",
                                     "on_overflow": "double"}))
    assert "\n" not in str(err.value)


def test_a_predictor_is_refused_where_nothing_consults_it():
    data = scenario({"kind": "contiguous", "reserve_policy": "oracle",
                     "predictor": {"sigma": 0.5}})
    with pytest.raises(ScenarioError, match="predictor: nothing in this system consults it") as err:
        scenario_from_dict(data)
    assert "\n" not in str(err.value)
    data = scenario({"kind": "contiguous", "reserve_policy": "predicted",
                     "predictor": {"sigma": -1}})
    with pytest.raises(ScenarioError, match=r"predictor\.sigma") as err:
        scenario_from_dict(data)
    assert "\n" not in str(err.value)


def test_a_prefill_replica_reserves_the_prompt_only():
    # Disaggregated, a prefill replica's request ends at its first token, whose KV it never
    # writes: an oracle reservation there is the prompt (it once took the whole request's
    # length); on the decode replica, the KV of 100 + 50 tokens.
    data = scenario({"kind": "contiguous", "reserve_policy": "oracle"},
                    engine={"replicas": 2,
                            "disaggregation": {"prefill_replicas": 1, "kv_transfer_gbps": 50}})
    data["workload"]["prompt_len"] = {"dist": "constant", "value": 100}
    data["workload"]["output_len"] = {"dist": "constant", "value": 50}
    memory = run_scenario(scenario_from_dict(data)).systems["oracle"].memory
    prefill = memory[memory["replica"] == 0]
    held = prefill["token"] + prefill["reserved"] + prefill["internal"]
    assert (held > 0).any() and (held % 100 == 0).all()
    decode = memory[memory["replica"] == 1]
    held = decode["token"] + decode["reserved"] + decode["internal"]
    assert (held > 0).any() and (held % 149 == 0).all()


PREDICTED_COLUMNS = {"arrival": "t", "prompt_len": "in", "output_len": "out",
                     "predicted_output": "guess"}


def trace_scenario(path, **prediction) -> dict:
    return {
        "name": "guesses", "model": "llama-2-7b", "memory": {"kv_memory_gib": 1},
        "workload": {"kind": "trace", "path": str(path), "format": "csv",
                     "columns": PREDICTED_COLUMNS, "max_tokens": 100},
        "systems": [{"name": "s", "allocator": {"kind": "contiguous",
                                                "reserve_policy": "predicted"},
                     "predictor": {"source": "trace", **prediction}}],
        "stop": {"num_requests": 3},
    }


def test_a_real_predictors_guesses_come_from_the_trace(tmp_path):
    # Three requests of 20 + 30 tokens: guessed right, too short (10) and too long (60).
    path = tmp_path / "guesses.csv"
    path.write_text("t,in,out,guess\n0,20,30,30\n0.001,20,30,10\n0.002,20,30,60\n")
    result = run_scenario(scenario_from_dict(trace_scenario(path)))
    rows = result.systems["s"].requests.set_index("request")
    assert rows["preemptions"].tolist() == [0, 2, 0]  # 10 → 20 → 40 output tokens reserved
    assert rows["allocated_at_finish"].tolist() == [49, 59, 79]  # KV of 20 + 30, 40, 60
    assert result.systems["s"].summary["reservation_overflows"] == 2
    # Headroom applies to a real predictor's guesses too: 10 × 1.5 → 15, then 30 fits.
    roomy = run_scenario(scenario_from_dict(trace_scenario(path, headroom=0.5)))
    assert roomy.systems["s"].requests["preemptions"].tolist() == [0, 1, 0]


def test_guesses_in_the_trace_are_checked_and_needed(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("t,in,out,guess\n0,20,30,30\n1,20,30,0\n")
    with pytest.raises(TraceImportError, match=r"bad.csv:3: column 'guess': expected an "
                                               r"integer from 1 to 2\^53, got '0'"):
        run_scenario(scenario_from_dict(trace_scenario(bad)))
    synthetic = scenario({"kind": "contiguous", "reserve_policy": "predicted",
                          "predictor": {"source": "trace"}})
    with pytest.raises(WorkloadError, match=r"systems\[predicted\]\.predictor\.source: "
                                            r"trace, but request 0 of synthetic has no "
                                            r"predicted_output") as err:
        run_scenario(scenario_from_dict(synthetic))
    assert "\n" not in str(err.value)
    with pytest.raises(ScenarioError, match="sigma applies to source: model only"):
        scenario_from_dict(trace_scenario(bad, sigma=0.3))


def test_guesses_survive_a_trace_table_round_trip():
    trace = Trace.from_columns(arrival_s=np.zeros(2), prompt_len=np.array([5, 6]),
                               output_len=np.array([3, 4]), predicted_output=np.array([2, 9]))
    again = Trace.from_frame(trace.to_frame())
    assert again.predicted_output.tolist() == [2, 9]
    assert trace.head(1).predicted_output.tolist() == [2]


def test_trace_stats_say_what_sigma_a_real_predictors_guesses_amount_to():
    # Guesses blurred exactly as the model does, at sigma 0.4: the estimate finds it.
    rng = np.random.default_rng(3)
    output = rng.integers(200, 2000, 5000)
    guess = np.round(output * np.exp(0.4 * rng.standard_normal(5000))).astype(np.int64)
    trace = Trace.from_columns(arrival_s=np.zeros(5000), prompt_len=np.full(5000, 10),
                               output_len=output, predicted_output=np.maximum(guess, 1))
    stats = trace_stats(trace)
    assert stats["prediction_sigma"] == pytest.approx(0.4, rel=0.05)
    assert stats["prediction_short_share"] == pytest.approx(0.5, abs=0.03)
    assert "prediction_sigma" not in trace_stats(Trace.from_columns(
        arrival_s=np.zeros(2), prompt_len=np.array([5, 6]), output_len=np.array([3, 4])))


def test_an_overflow_under_swap_parks_the_kv_instead_of_recomputing_it():
    data = scenario({"kind": "contiguous", "reserve_policy": "predicted",
                     "predictor": {"sigma": 1.0}})
    data["systems"][0]["scheduler"] = {"preemption_mode": "swap", "swap_space_gib": 16}
    data["stop"] = {"num_requests": 200}
    summary = run_scenario(scenario_from_dict(data)).systems["predicted"].summary
    assert summary["reservation_overflows"] > 20
    # Every preemption was an overflow, and every one was swapped: nothing recomputed.
    assert summary["swap_preemptions"] == summary["preemptions"] == (
        summary["reservation_overflows"])
    assert summary["recomputed_tokens"] == 0 and summary["completed"] == 200
