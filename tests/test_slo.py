"""Service-level objectives: attainment and goodput per run, capacity search, figures."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from conftest import kvsim_in_process

from reports.sweep_report import capacity_on_grid
from sim.capacity import CapacityError, find_capacity, search
from sim.engine import run_scenario
from sim.metrics import format_summary
from sim.provenance import build_id, made_by
from sim.scenario import ScenarioError, SloConfig, scenario_from_dict
from sim.slo import SLO_KEYS, describe_slo, in_time, judged_attainment, slo_summary


def requests_table(rows: list[tuple[float, float, float, int, bool]]) -> pd.DataFrame:
    """(arrival, first token, finished, output_len, rejected); NaN times: never reached."""
    frame = pd.DataFrame(rows, columns=["arrival_s", "first_token_s", "finished_s",
                                        "output_len", "rejected"])
    frame["n"] = 1
    return frame


def test_attainment_counts_every_bound_and_every_request():
    nan = math.nan
    table = requests_table([
        (0.0, 0.5, 5.5, 101, False),   # TTFT 0.5, TPOT 0.05, E2E 5.5: all met
        (1.0, 2.5, 3.5, 11, False),    # TTFT 1.5: misses TTFT only
        (2.0, 2.2, 22.2, 101, False),  # TPOT 0.2: misses TPOT (and E2E 20.2)
        (3.0, 3.1, 3.1, 1, False),     # one output token: no TPOT to miss
        (4.0, 4.9, 10.9, 61, False),   # TTFT 0.9, TPOT exactly 0.1: bounds are inclusive
        (5.0, nan, nan, 50, True),     # rejected: never in time
    ])
    slo = SloConfig(ttft_s=1.0, tpot_s=0.1, e2e_s=15.0)
    met = in_time(table, slo)
    assert met["ttft"].tolist() == [True, False, True, True, True, False]
    assert met["tpot"].tolist() == [True, True, False, True, True, False]
    assert met["e2e"].tolist() == [True, True, False, True, True, False]
    assert met["all"].tolist() == [True, False, False, True, True, False]
    summary = slo_summary(table, makespan_s=12.0, slo=slo)
    assert summary["slo_attainment"] == pytest.approx(3 / 6)
    assert summary["goodput_req_s"] == pytest.approx(3 / 12.0)
    assert summary["slo_ttft_attainment"] == pytest.approx(4 / 6)
    assert summary["slo_tpot_attainment"] == pytest.approx(4 / 6)
    # The summary's copy of the table marks unfinished times -1, not NaN: still a miss.
    marked = table.fillna({"first_token_s": -1.0, "finished_s": -1.0})
    assert in_time(marked, slo)["all"].tolist() == met["all"].tolist()
    # Only the bounds given are checked.
    only_ttft = in_time(table, SloConfig(ttft_s=1.0))
    assert set(only_ttft) == {"ttft", "all"}
    assert only_ttft["all"].tolist() == met["ttft"].tolist()
    assert slo_summary(table, 12.0, None) == dict.fromkeys(SLO_KEYS)


def test_the_longest_gap_bound_judges_each_streams_worst_stall():
    nan = math.nan
    table = requests_table([
        (0.0, 0.5, 5.5, 101, False),   # its worst wait between two tokens 0.3 s: met
        (1.0, 1.5, 8.5, 101, False),   # TPOT 0.07 on average, but one stall of 2 s
        (2.0, 2.1, 2.1, 1, False),     # one output token: no gap to miss
        (3.0, 3.2, nan, 40, False),    # given up mid-answer: never in time
    ])
    table["max_itl_s"] = [0.3, 2.0, nan, 0.4]
    slo = SloConfig(tpot_s=0.1, max_itl_s=1.0)
    met = in_time(table, slo)
    assert met["tpot"].tolist() == [True, True, True, False]
    assert met["max_itl"].tolist() == [True, False, True, False]
    assert met["all"].tolist() == [True, False, True, False]
    summary = slo_summary(table, makespan_s=10.0, slo=slo)
    assert summary["slo_max_itl_attainment"] == summary["slo_attainment"] == 0.5
    assert summary["slo_tpot_attainment"] == 0.75
    assert describe_slo(slo.model_dump()) == (
        "TPOT ≤ 100 ms, longest token gap ≤ 1 s for 90% of requests")
    # Judged by percentiles, the bound fewer requests meet decides.
    by_percentiles = SloConfig(tpot_s=0.1, max_itl_s=1.0, judge="percentiles")
    judged = slo_summary(table, 10.0, by_percentiles)
    assert judged["slo_tightest_attainment"] == 0.5
    assert describe_slo(by_percentiles.model_dump()) == (
        "p90 TPOT ≤ 100 ms, p90 longest token gap ≤ 1 s")


def test_a_run_judges_the_longest_gaps_it_measured():
    result = run_scenario(scenario_from_dict(scenario(slo={"max_itl_s": 0.03})))
    for run in result.systems.values():
        requests = run.requests
        assert requests["max_itl_s"].notna().sum() > 50
        # One output token, or none served: nothing to hold against the bound, or a miss.
        within = ((requests["max_itl_s"] <= 0.03) | (requests["output_len"] == 1)) & (
            requests["finished_s"].notna())
        assert run.summary["slo_max_itl_attainment"] == pytest.approx(within.mean())
        assert run.summary["slo_attainment"] == run.summary["slo_max_itl_attainment"]
    # Paged memory seats a batch several times larger, whose steps are longer.
    paged, contiguous = (result.systems[name].summary for name in ("paged", "contiguous"))
    assert 0 < paged["slo_attainment"] < contiguous["slo_attainment"]


@pytest.mark.parametrize("slo, message", [
    ({}, "slo: give at least one of ttft_s, tpot_s, e2e_s"),
    ({"ttft_s": 1, "attainment": 1.5}, "slo.attainment: Input should be less than or equal"),
    ({"tpot_s": -0.1}, "slo.tpot_s: Input should be greater than 0"),
    ({"ttft": 1}, "slo.ttft: unknown key; did you mean 'ttft_s'?"),
])
def test_bad_objectives_are_refused_in_one_line(slo, message):
    with pytest.raises(ScenarioError) as error:
        scenario_from_dict(scenario(slo=slo), "s.yaml")
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def scenario(rate: float = 4.0, slo: dict | None = None, **extra) -> dict:
    """Two systems on a 3 GiB pool: contiguous max-length reservation wastes most of it."""
    data = {
        "name": "slo",
        "model": "llama-2-7b", "gpu": "a100-80g", "memory": {"kv_memory_gib": 3},
        "workload": {"arrival": {"process": "poisson", "rate": rate},
                     "prompt_len": {"dist": "lognormal", "mean": 300, "sigma": 0.8,
                                    "max": 1500},
                     "output_len": {"dist": "lognormal", "mean": 150, "sigma": 0.8,
                                    "max": 600}},
        "systems": [{"name": "contiguous", "allocator": {"kind": "contiguous"}},
                    {"name": "paged", "allocator": {"kind": "paged"}}],
        "stop": {"num_requests": 150},
        **extra,
    }
    if slo is not None:
        data["slo"] = slo
    return data


OBJECTIVES = {"ttft_s": 1.0, "tpot_s": 0.05}


def test_a_run_reports_what_its_request_table_shows():
    result = run_scenario(scenario_from_dict(scenario(slo=OBJECTIVES)))
    for run in result.systems.values():
        requests = run.requests
        ttft = requests["first_token_s"] - requests["arrival_s"]
        gaps = (requests["output_len"] - 1).clip(lower=1)
        tpot = ((requests["finished_s"] - requests["first_token_s"]) / gaps).where(
            requests["output_len"] > 1, 0.0)
        in_time_by_hand = (ttft <= 1.0) & (tpot <= 0.05)
        assert run.summary["slo_attainment"] == pytest.approx(in_time_by_hand.mean())
        assert run.summary["goodput_req_s"] == pytest.approx(
            in_time_by_hand.sum() / run.summary["makespan_s"])
    table = format_summary({n: r.summary for n, r in result.systems.items()})
    assert "requests within SLO" in table and "goodput" in table
    # Paged memory holds a larger batch at the same rate: more requests are in time.
    contiguous, paged = (result.systems[n].summary["slo_attainment"]
                         for n in ("contiguous", "paged"))
    assert paged > contiguous
    without = run_scenario(scenario_from_dict(scenario()))
    summaries = {n: r.summary for n, r in without.systems.items()}
    assert all(s[k] is None for s in summaries.values() for k in SLO_KEYS)
    assert "within SLO" not in format_summary(summaries)
    # Objectives judge a run; they never change it.
    for name, run in without.systems.items():
        pd.testing.assert_frame_equal(run.requests, result.systems[name].requests)


def test_search_brackets_the_limit_from_either_side():
    for start in (0.3, 3.0, 40.0):
        calls: list[float] = []

        def holds(load: float, calls: list[float] = calls) -> bool:
            calls.append(load)
            return load <= 3.7

        held, failed, converged = search(holds, start, rel_tol=0.01, max_probes=40)
        assert converged and held is not None and failed is not None
        assert held <= 3.7 < failed <= held * 1.01
        assert calls[0] == start
    assert search(lambda load: False, 1.0, rel_tol=0.01, max_probes=40)[:2] == (None,
                                                                                 1 / 1024)
    held, failed, converged = search(lambda load: True, 1.0, rel_tol=0.01, max_probes=40)
    assert (held, failed, converged) == (1024.0, None, True)
    held, failed, converged = search(lambda load: load <= 3.7, 1.0, rel_tol=1e-6,
                                     max_probes=6)
    assert not converged and held is not None and failed is not None and held < failed


def test_capacity_is_the_load_where_attainment_crosses_the_target():
    data = scenario(slo={**OBJECTIVES, "attainment": 0.8})
    knob, capacities = find_capacity(scenario_from_dict(data), Path(), rel_tol=0.05)
    assert knob.path == "workload.arrival.rate" and knob.start == 4.0
    by_name = {c.system: c for c in capacities}
    for c in capacities:
        assert c.converged and c.held is not None and c.failed is not None
        assert c.failed / c.held - 1 <= 0.05
        assert c.at(c.held).attainment >= 0.8 > c.at(c.failed).attainment
        # Every probe that held ran at a load no heavier than any probe that missed, or
        # the search would have moved past it.
        assert max(p.load for p in c.probes if p.holds) == c.held
        # The probe at capacity is an ordinary run of the scenario at that rate.
        direct = run_scenario(scenario_from_dict(scenario(rate=c.held, slo={
            **OBJECTIVES, "attainment": 0.8}))).systems[c.system].summary
        assert direct == c.at(c.held).summary
    assert by_name["paged"].held > 1.5 * by_name["contiguous"].held


def test_systems_searched_at_once_find_the_same(capfd):
    """kvsim capacity searches each system in a process of its own, which prints its probes
    as they end: the same probes, in each system's order, as one search after another."""
    import functools

    from sim.cli import _print_probe

    data = scenario(slo={**OBJECTIVES, "attainment": 0.8})
    _, alone = find_capacity(scenario_from_dict(data), Path(), rel_tol=0.05)
    progress = functools.partial(_print_probe, slo=data["slo"])
    _, together = find_capacity(scenario_from_dict(data), Path(), rel_tol=0.05, jobs=2,
                                progress=progress)
    assert [c.system for c in together] == [c.system for c in alone]
    assert together == alone  # every probe, its summary included
    printed = capfd.readouterr().err.splitlines()  # written by the worker processes
    assert len(printed) == sum(len(c.probes) for c in alone)
    for c in alone:
        mine = [line for line in printed if line.startswith(f"  {c.system}: ")]
        assert [float(line.split()[1]) for line in mine] == pytest.approx(
            [p.offered_req_s for p in c.probes], rel=1e-3)


def _capacity_json(tmp_path: Path, data: dict, *args: str) -> tuple[Any, dict]:
    """``kvsim capacity`` of system paged on the scenario ``data``, written to
    ``tmp_path/s.yaml`` (with ``args``): the finished process and the capacity.json it
    wrote."""
    import yaml

    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(data))
    proc = kvsim_in_process("capacity", str(path), "--system", "paged", "--rel-tol", "0.05",
                            *args, "--out", str(tmp_path / "out"), "--quiet")
    assert proc.returncode == 0, proc.stderr
    return proc, json.loads((tmp_path / "out" / "capacity.json").read_text())


def _print_probes(system: str, count: int) -> None:
    from sim.capacity import Probe
    from sim.cli import _print_probe

    for i in range(count):
        _print_probe(Probe(system, i, float(i), 0.9, True, {}), slo=OBJECTIVES)


def test_probe_lines_from_processes_at_once_stay_whole(capfd):
    """Searches in processes of their own print to one stderr at once: each line is one
    write, so no line lands inside another."""
    from concurrent.futures import ProcessPoolExecutor

    systems, count = ["contiguous", "paged", "hybrid", "vattention"], 400
    with ProcessPoolExecutor(max_workers=len(systems)) as pool:
        list(pool.map(_print_probes, systems, [count] * len(systems)))
    printed = capfd.readouterr().err.splitlines()
    for system in systems:
        mine = [line for line in printed if line.startswith(f"  {system}: ")]
        assert [float(line.split()[1]) for line in mine] == list(range(count))
        assert all(line.endswith(" within SLO, holds") for line in mine)


def test_percentiles_judge_each_bound_alone():
    # Half the requests miss TTFT only, the other half TPOT only: none is in time, but each
    # bound's median holds.
    table = requests_table([(0.0, 2.0, 2.9, 10, False)] * 5 + [(0.0, 0.5, 9.5, 10, False)] * 5)
    slo = SloConfig(ttft_s=1.0, tpot_s=0.2, attainment=0.5)
    summary = slo_summary(table, 10.0, slo)
    assert summary["slo_attainment"] == 0.0
    assert judged_attainment(summary, slo.model_dump()) == 0.0
    by_percentiles = slo.model_copy(update={"judge": "percentiles"}).model_dump()
    assert judged_attainment(summary, by_percentiles) == 0.5
    # The summary names the tightest bound's share only when it is what is judged.
    assert summary["slo_tightest_attainment"] is None
    judged = slo_summary(table, 10.0, SloConfig(**by_percentiles))
    assert judged["slo_tightest_attainment"] == 0.5
    assert "requests within tightest bound" in format_summary({"s": judged})
    assert "tightest" not in format_summary({"s": summary})
    # A table of summaries, column by column; absent bounds are not judged.
    rows = pd.DataFrame([summary, {**summary, "slo_tpot_attainment": 0.25}])
    assert judged_attainment(rows, by_percentiles).tolist() == [0.5, 0.25]
    assert judged_attainment(rows, {**by_percentiles, "tpot_s": None}).tolist() == [0.5, 0.5]
    assert describe_slo(slo.model_dump()) == "TTFT ≤ 1 s, TPOT ≤ 200 ms for 50% of requests"
    assert describe_slo({"ttft_s": 2.0, "tpot_s": 0.2, "attainment": 0.99,
                         "judge": "percentiles"}) == "p99 TTFT ≤ 2 s, p99 TPOT ≤ 200 ms"


def test_capacity_by_percentiles_keeps_each_percentile_within_its_bound():
    objectives = {**OBJECTIVES, "attainment": 0.9}
    data = scenario(slo={**objectives, "judge": "percentiles"})
    _, capacities = find_capacity(scenario_from_dict(data), Path(), rel_tol=0.05,
                                  systems=["paged"])
    _, jointly = find_capacity(scenario_from_dict(scenario(slo=objectives)), Path(),
                               rel_tol=0.05, systems=["paged"])
    (paged,), (joint,) = capacities, jointly
    # Meeting each bound alone is easier than meeting both at once.
    assert paged.held >= joint.held
    # At capacity the 90th percentiles are within their bounds; at the miss one is not.
    for load, holds in ((paged.held, True), (paged.failed, False)):
        requests = run_scenario(scenario_from_dict(scenario(rate=load, slo=data["slo"]))
                                ).systems["paged"].requests
        ttft = requests["first_token_s"] - requests["arrival_s"]
        tpot = ((requests["finished_s"] - requests["first_token_s"])
                / (requests["output_len"] - 1).clip(lower=1)).where(
                    requests["output_len"] > 1, 0.0)
        rank = math.ceil(0.9 * len(requests)) - 1  # nearest-rank p90 (NaN, a miss, sorts last)
        within = (np.sort(ttft.to_numpy())[rank] <= 1.0
                  and np.sort(tpot.to_numpy())[rank] <= 0.05)
        assert within == holds


def test_a_replayed_trace_is_searched_by_its_speed():
    data = {**scenario(slo={"ttft_s": 2.0}),
            "workload": {"kind": "trace", "path": "builtin:azure_llm_2023_conv.csv",
                         "arrival": {"process": "trace", "speed": 2.0}},
            "model": "llama-3.1-8b", "gpu": "h100-80g", "memory": {"kv_memory_gib": 4},
            "stop": {"num_requests": 200}}
    data["systems"] = data["systems"][1:]
    knob, (paged,) = find_capacity(scenario_from_dict(data), Path(), rel_tol=0.1)
    assert knob.path == "workload.arrival.speed" and knob.start == 2.0
    from sim.engine import scenario_trace

    trace = scenario_trace(scenario_from_dict(data), Path())
    span = float(trace.arrival_s.max() - trace.arrival_s.min())
    # Replayed at speed 2 the trace offers (n − 1) / span requests per second.
    assert knob.offered_req_s(2.0) == pytest.approx((len(trace) - 1) / span)
    assert paged.held is not None and paged.at(paged.held).holds


def test_capacity_command_writes_its_results_and_refuses_what_it_cannot_search(tmp_path):
    import yaml

    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(scenario(slo=OBJECTIVES)))
    out = tmp_path / "cap"
    printed = kvsim_in_process("capacity", str(path), "--system", "paged", "--rel-tol", "0.1",
                               "--out", str(out))
    assert printed.returncode == 0, printed.stderr
    assert all(text in printed.stdout for text in ("paged", "req/s", "at capacity:"))
    assert "within SLO, holds" in printed.stderr  # one line per run
    result = json.loads((out / "capacity.json").read_text())
    paged = result["systems"]["paged"]
    assert set(result["systems"]) == {"paged"}
    probes = pd.read_csv(out / "probes.csv")
    assert len(probes) == paged["runs"]
    assert probes.loc[probes["holds"], "load"].max() == paged["capacity_load"]
    assert (probes.loc[probes["holds"], "slo_attainment"] >= 0.9).all()
    assert (out / "capacity.png").stat().st_size > 10_000
    # kvsim report draws the figure again from the files, the same to the byte, and a page.
    drawn = (out / "capacity.png").read_bytes()
    (out / "capacity.png").unlink()
    (out / "report.html").unlink()
    redrawn = kvsim_in_process("report", str(out))
    assert redrawn.returncode == 0, redrawn.stderr
    assert (out / "capacity.png").read_bytes() == drawn
    page = (out / "report.html").read_text()
    assert "<td>paged</td>" in page and f"{paged['capacity_req_s']:,.4g}" in page
    assert "<h2>Resolved scenario</h2>" in page
    # Which kvsim found it: in the answer, and on the page.
    assert result["made_by"] == made_by()
    assert f"<td>results made by</td><td>kvsim {result['made_by']['kvsim']} (build " in page
    # The same command again reads every run back, and writes the same files.
    kept = kvsim_in_process("capacity", str(path), "--system", "paged", "--rel-tol", "0.1",
                            "--out", str(out), "--no-report")
    assert kept.returncode == 0, kept.stderr
    assert kept.stdout.startswith(f"resuming: {paged['runs']} runs of the searches read "
                                  f"back from {out / 'probes'}, made before by this kvsim "
                                  "build\n")
    assert kept.stderr.count("(run before)\n") == paged["runs"]
    assert json.loads((out / "capacity.json").read_text()) == result
    pd.testing.assert_frame_equal(pd.read_csv(out / "probes.csv"), probes)
    # Two searches are no runs to compare: said in a line, with what does compare them.
    compared = kvsim_in_process("compare", str(out), str(out))
    assert compared.returncode == 2 and compared.stderr == (
        f"kvsim: error: {out}: a kvsim capacity folder; capacities under other settings are "
        f"compared by kvsim capacity --sweep (a sweep over what differs), and kvsim report "
        f"{out} shows this one\n")
    (out / "probes.csv").write_text("a,b\n1,2\n")  # damaged: said in a line
    damaged = kvsim_in_process("report", str(out))
    assert damaged.returncode == 2 and damaged.stderr == (
        f"kvsim: error: {out / 'probes.csv'}: cannot be read back (no 'system' field)\n")
    # The command line's bounds replace the file's: a looser TTFT allows a higher rate.
    loose = tmp_path / "loose"
    assert kvsim_in_process("capacity", str(path), "--system", "paged", "--rel-tol", "0.1",
                            "--tpot-s", "0.2", "--out", str(loose), "--quiet",
                            "--no-report").returncode == 0
    assert sorted(p.name for p in loose.iterdir()) == ["capacity.json", "probes",
                                                       "probes.csv", "scenario.yaml"]
    kept = yaml.safe_load((loose / "scenario.yaml").read_text())
    assert kept["slo"]["tpot_s"] == 0.2 and kept["slo"]["ttft_s"] == 1.0  # as searched
    looser = json.loads((loose / "capacity.json").read_text())
    assert looser["slo"]["tpot_s"] == 0.2 and looser["slo"]["ttft_s"] == 1.0
    assert looser["systems"]["paged"]["capacity_load"] >= paged["capacity_load"]
    # Judged by percentiles: said so in each line and the heading, and never lower.
    by_percentiles = kvsim_in_process("capacity", str(path), "--system", "paged", "--rel-tol",
                                      "0.1", "--judge", "percentiles", "--out",
                                      str(tmp_path / "p90"))
    assert by_percentiles.returncode == 0, by_percentiles.stderr
    assert "within the tightest bound, holds" in by_percentiles.stderr
    assert "capacity with p90 TTFT ≤ 1 s, p90 TPOT ≤ 50 ms," in by_percentiles.stdout
    p90 = json.loads((tmp_path / "p90" / "capacity.json").read_text())
    assert p90["slo"]["judge"] == "percentiles"
    assert p90["systems"]["paged"]["capacity_load"] >= paged["capacity_load"]

    def refused(data: dict, *args: str) -> str:
        path.write_text(yaml.safe_dump(data))
        proc = kvsim_in_process("capacity", str(path), "--out", str(tmp_path / "x"), *args)
        assert proc.returncode == 2
        err = proc.stderr.strip()
        assert "\n" not in err
        return err

    assert "no slo section" in refused(scenario())
    closed = scenario(slo=OBJECTIVES)
    closed["workload"]["arrival"] = {"process": "closed_loop", "users": 8}
    assert "closed_loop arrivals have no rate" in refused(closed)
    assert "--system nope: no such system; systems: contiguous, paged" in refused(
        scenario(slo=OBJECTIVES), "--system", "nope")
    assert "slo.attainment" in refused(scenario(slo=OBJECTIVES), "--attainment", "2")


def test_a_search_keeps_each_run_and_reads_it_back_where_it_is_the_same(tmp_path):
    from sim.capacity import probe_file

    base = scenario_from_dict(scenario(slo=OBJECTIVES))
    probes = tmp_path / "probes"
    _, (scratch,) = find_capacity(base, Path(), rel_tol=0.1, systems=["paged"])

    # Stopped after its third run: those three are kept; the search goes on from there.
    def stop_after_three(probe) -> None:
        if len(list(probes.iterdir())) == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        find_capacity(base, Path(), rel_tol=0.1, systems=["paged"], probe_dir=probes,
                      progress=stop_after_three)
    _, (resumed,) = find_capacity(base, Path(), rel_tol=0.1, systems=["paged"],
                                  probe_dir=probes)
    assert [p.kept for p in resumed.probes] == [True] * 3 + [False] * (
        len(resumed.probes) - 3)
    assert (resumed.held, resumed.failed) == (scratch.held, scratch.failed)
    assert [(p.load, p.summary) for p in resumed.probes] == [
        (p.load, p.summary) for p in scratch.probes]
    # A tighter tolerance walks the same path first: every run of the looser one is read back.
    _, (tighter,) = find_capacity(base, Path(), rel_tol=0.02, systems=["paged"],
                                  probe_dir=probes)
    assert [p.kept for p in tighter.probes[:len(scratch.probes)]] == [True] * len(
        scratch.probes)
    assert not any(p.kept for p in tighter.probes[len(scratch.probes):])
    # Another scenario is another run; a damaged file, or one another build made, is run
    # again.
    other = scenario_from_dict(scenario(slo={**OBJECTIVES, "ttft_s": 2.0}))
    _, (looser,) = find_capacity(other, Path(), rel_tol=0.1, systems=["paged"],
                                 probe_dir=probes)
    assert not any(p.kept for p in looser.probes)
    start = base.workload.arrival.rate
    variant = scenario_from_dict(scenario(rate=start, slo=OBJECTIVES))
    first = probe_file(probes, variant, "paged", Path())
    assert first.is_file()
    for damage in ({"summary": {"throughput_tok_s": "fast"}}, {"build": "0" * 12}):
        file_text = first.read_text()
        first.write_text(json.dumps({**json.loads(file_text), **damage}))
        _, (again,) = find_capacity(base, Path(), rel_tol=0.1, systems=["paged"],
                                    probe_dir=probes)
        assert [p.kept for p in again.probes][:2] == [False, True]
        assert json.loads(first.read_text()) == json.loads(file_text)  # written again


def test_capacity_on_a_grid_stops_at_the_first_miss():
    grid = pd.DataFrame({"rate": [1, 2, 4, 8, 16], "slo_attainment": [1.0, 0.95, 0.85,
                                                                      0.92, 0.1]})

    def slo(attainment: float) -> dict:
        return {"ttft_s": 1.0, "attainment": attainment}

    assert capacity_on_grid(grid, "rate", slo(0.9)) == 2.0
    assert capacity_on_grid(grid, "rate", slo(0.99)) == 1.0
    assert capacity_on_grid(grid, "rate", slo(0.05)) == 16.0
    assert capacity_on_grid(grid.iloc[::-1], "rate", slo(0.9)) == 2.0  # order does not matter
    assert capacity_on_grid(grid.assign(slo_attainment=0.0), "rate", slo(0.9)) is None


def test_a_rate_sweep_with_objectives_draws_attainment(tmp_path):
    import yaml

    from reports.sweep_report import sweep_figures
    from sim.sweep import run_sweep

    data = scenario(slo=OBJECTIVES)
    data["stop"] = {"num_requests": 60}
    data["sweep"] = {"grid": {"workload.arrival.rate": [1, 4, 16]}}
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(data))
    outcome = run_sweep(path, out_dir=tmp_path / "sweep", jobs=1)
    assert outcome.table["slo_attainment"].dtype == np.float64
    figures = sweep_figures(tmp_path / "sweep")
    capacities = figures["slo_attainment"].kvsim_data["capacities"]
    table = outcome.table
    for system, capacity in capacities.items():
        part = table[table["system"] == system].sort_values("param:workload.arrival.rate")
        holding = part["slo_attainment"].to_numpy() >= 0.9
        expected = (part["param:workload.arrival.rate"].to_numpy()[:holding.argmin()]
                    if not holding.all() else part["param:workload.arrival.rate"].to_numpy())
        assert (capacity if not math.isnan(capacity) else None) == (
            float(expected[-1]) if len(expected) else None)
    # A sweep without objectives draws no such figure.
    del data["slo"]
    path.write_text(yaml.safe_dump(data))
    run_sweep(path, out_dir=tmp_path / "plain", jobs=1)
    assert "slo_attainment" not in sweep_figures(tmp_path / "plain")


def test_latency_figure_marks_the_bounds_and_plots_the_same_latencies():
    from reports.run_figures import latency_cdfs

    result = run_scenario(scenario_from_dict(scenario(slo={"ttft_s": 1.5, "tpot_s": 0.04,
                                                           "max_itl_s": 0.5})))
    fig = latency_cdfs(result)
    bounds = [[line.get_xdata()[0] for line in ax.get_lines() if line.get_label() == "SLO"]
              for ax in fig.axes]
    assert bounds == [[1.5], [40.0], [], [0.5]]  # TPOT is drawn in ms; no E2E bound given
    paged = result.systems["paged"].requests
    ttft = np.sort((paged["first_token_s"] - paged["arrival_s"]).to_numpy())
    np.testing.assert_allclose(fig.kvsim_data["TTFT (s)"]["paged"].to_numpy(), ttft)
    multi = paged[paged["output_len"] > 1]
    tpot_ms = np.sort(((multi["finished_s"] - multi["first_token_s"])
                       / (multi["output_len"] - 1)).to_numpy() * 1000)
    assert len(fig.kvsim_data["TPOT (ms)"]["paged"].dropna()) == len(tpot_ms)
    np.testing.assert_allclose(fig.kvsim_data["TPOT (ms)"]["paged"].dropna().to_numpy(),
                               tpot_ms)
    np.testing.assert_allclose(
        fig.kvsim_data["longest token gap (s)"]["paged"].dropna().to_numpy(),
        np.sort(multi["max_itl_s"].to_numpy()))


def test_an_slo_nothing_meets_gives_no_capacity_rather_than_an_error():
    # Halving the rate under a duration stop soon leaves no requests to judge: the search
    # ends there with "none", the lightest load tried as the one that missed.
    data = scenario(rate=1.0, slo={"ttft_s": 1e-6}, stop={"duration_s": 20})
    knob, capacities = find_capacity(scenario_from_dict(data), Path(), systems=["paged"])
    (paged,) = capacities
    assert paged.held is None and paged.converged
    assert paged.failed == min(p.load for p in paged.probes) < knob.start
    assert not any(p.holds for p in paged.probes)


def sweep_file(tmp_path: Path, sweep: dict, **extra) -> Path:
    import yaml

    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({**scenario(slo=OBJECTIVES, **extra), "sweep": sweep}))
    return path


def test_a_sweep_searches_each_point_with_its_rate_axis_dropped(tmp_path):
    from sim.capacity import capacity_points, capacity_sweep

    path = sweep_file(tmp_path, {"grid": {"workload.arrival.rate": [1, 2, 4],
                                          "memory.kv_memory_gib": [2, 4]}})
    _, points = capacity_points(path)
    assert [p.params for p in points] == [{"memory.kv_memory_gib": 2},
                                          {"memory.kv_memory_gib": 4}]
    table = capacity_sweep(path, jobs=2, rel_tol=0.05).table
    assert list(table["system"]) == ["contiguous", "paged"] * 2
    assert (table["status"] == "ok").all()
    for point in points:  # each row is that point's own search
        _, capacities = find_capacity(scenario_from_dict(point.scenario), Path(),
                                      rel_tol=0.05)
        rows = table[table["param:memory.kv_memory_gib"] == point.params[
            "memory.kv_memory_gib"]].set_index("system")
        for c in capacities:
            assert rows.loc[c.system, "capacity_req_s"] == c.held
            assert rows.loc[c.system, "slo_attainment"] == c.at(c.held).attainment
    # A larger pool sustains at least the load of a smaller one.
    by_pool = table.pivot_table(index="system", columns="param:memory.kv_memory_gib",
                                values="capacity_req_s")
    assert (by_pool[4] >= by_pool[2]).all()
    with pytest.raises(CapacityError, match=r"sweep\.zip: moves workload\.arrival\.rate with"):
        capacity_points(sweep_file(tmp_path, {"zip": {"workload.arrival.rate": [1, 2],
                                                      "memory.kv_memory_gib": [2, 4]}}))


def test_a_capacity_sweep_keeps_each_point_searched_and_resumes(tmp_path):
    from sim.capacity import POINTS_FOLDER, capacity_points, capacity_sweep, point_file

    path = sweep_file(tmp_path, {"grid": {"memory.kv_memory_gib": [2, 4]}})
    out = tmp_path / "out"
    scratch = capacity_sweep(path, jobs=2, rel_tol=0.1)  # no folder: nothing kept
    assert (scratch.searched, scratch.skipped) == (2, 0)

    # Killed after its first point: that point's search is kept; the next call goes on.
    def stop_after_one(total: int, skipped: int):
        def tick(n: int) -> None:
            raise KeyboardInterrupt
        return tick

    with pytest.raises(KeyboardInterrupt):
        capacity_sweep(path, jobs=1, rel_tol=0.1, out_dir=out, systems=["paged"],
                       progress=stop_after_one)
    assert len(list((out / POINTS_FOLDER).iterdir())) == 1
    paged = capacity_sweep(path, jobs=2, rel_tol=0.1, out_dir=out, systems=["paged"])
    assert (paged.searched, paged.skipped) == (1, 1)
    # The other system is searched alone, and the table is the one from scratch.
    both = capacity_sweep(path, jobs=2, rel_tol=0.1, out_dir=out)
    assert (both.searched, both.skipped, both.older) == (2, 0, 0)
    pd.testing.assert_frame_equal(both.table, scratch.table)
    again = capacity_sweep(path, jobs=2, rel_tol=0.1, out_dir=out)
    assert (again.searched, again.skipped) == (0, 2)
    pd.testing.assert_frame_equal(again.table, scratch.table)
    # Another tolerance is another search.
    other = capacity_sweep(path, jobs=2, rel_tol=0.2, out_dir=out)
    assert (other.searched, other.skipped) == (2, 0)

    # A point another build searched is kept and counted, or searched again on request; a
    # damaged file is searched again.
    files = sorted((out / POINTS_FOLDER).iterdir())
    kept = json.loads(files[0].read_text())
    for row in kept["rows"]:
        row["build"] = "0" * 12
    files[0].write_text(json.dumps(kept))
    files[1].write_text('{"rows": [{"system": "paged"')
    resumed = capacity_sweep(path, jobs=2, rel_tol=0.1, out_dir=out)
    resumed_other = capacity_sweep(path, jobs=2, rel_tol=0.2, out_dir=out)
    assert resumed.older + resumed_other.older == 1
    assert resumed.searched + resumed_other.searched == 1
    older = resumed if resumed.older else resumed_other
    assert set(older.table["build"]) == {"0" * 12, build_id()}
    rerun = capacity_sweep(path, jobs=2, rel_tol=0.1 if resumed.older else 0.2,
                           out_dir=out, rerun_older=True)
    assert (rerun.searched, rerun.older) == (1, 1)
    assert set(rerun.table["build"]) == {build_id()}
    # A metric of the run at capacity that is no number is damage too.
    file = point_file(out, capacity_points(path)[1][0], 0.1, 24)
    damaged = json.loads(file.read_text())
    damaged["rows"][0]["throughput_tok_s"] = "fast"
    file.write_text(json.dumps(damaged))
    assert capacity_sweep(path, jobs=2, rel_tol=0.1, out_dir=out).searched == 1


def test_capacity_sweep_command_resumes_to_the_same_table(tmp_path):
    path = sweep_file(tmp_path, {"grid": {"memory.kv_memory_gib": [2, 4]}})
    command = ("capacity", str(path), "--sweep", "--jobs", "2", "--rel-tol", "0.1", "--out",
               str(tmp_path / "out"), "--quiet", "--no-report")
    first = kvsim_in_process(*command)
    assert first.returncode == 0, first.stderr
    assert "capacity: 2 points searched, 0 searched before, 0 failed" in first.stdout
    table = (tmp_path / "out" / "capacity.parquet").read_bytes()
    again = kvsim_in_process(*command)
    assert again.returncode == 0, again.stderr
    assert "capacity: 0 points searched, 2 searched before, 0 failed" in again.stdout
    assert (tmp_path / "out" / "capacity.parquet").read_bytes() == table
    # One point lost, the other searched by another build: one searched, one kept and told.
    first_file, second_file = sorted((tmp_path / "out" / "points").iterdir())
    first_file.unlink()
    kept = json.loads(second_file.read_text())
    for row in kept["rows"]:
        row["build"] = "0" * 12
    second_file.write_text(json.dumps(kept))
    partly = kvsim_in_process(*command)
    assert partly.returncode == 0, partly.stderr
    assert "resuming: 1 point searched before skipped" in partly.stdout
    assert "capacity: 1 point searched, 1 searched before, 0 failed" in partly.stdout
    assert (f"note: 1 of the points done before was done by another kvsim build than this "
            f"one ({build_id()}), and is kept (capacity.parquet's build column names each "
            "one's): --rerun-older searches it again") in partly.stdout
    rerun = kvsim_in_process(*command, "--rerun-older")
    assert "note: 1 point done by another kvsim build was done again" in rerun.stdout
    assert (tmp_path / "out" / "capacity.parquet").read_bytes() == table
    # A folder whose sweep stopped before its table was written is told as one.
    (tmp_path / "out" / "capacity.parquet").unlink()
    unfinished = kvsim_in_process("report", str(tmp_path / "out"))
    assert unfinished.returncode == 2
    assert unfinished.stderr == (
        f"kvsim: error: {tmp_path / 'out'}: a kvsim capacity --sweep that did not finish (no "
        "capacity.parquet yet; points/ keeps the points it searched): the same command again "
        "searches the rest and writes it\n")
    # Options that only a sweep uses are refused without --sweep, and nothing is made.
    for option in (["--quick"], ["--executor", "ray"], ["--address", "auto"],
                   ["--rerun-older"]):
        refused = kvsim_in_process("capacity", str(path), *option, "--out",
                                   str(tmp_path / "x"))
        assert refused.returncode == 2
        assert refused.stderr.startswith(f"kvsim: error: {option[0]} goes with --sweep: ")
        assert refused.stderr.count("\n") == 1
    assert not (tmp_path / "x").exists()


def test_quick_capacity_quarters_each_trace_file_of_the_grid(tmp_path):
    import yaml

    from sim.capacity import capacity_points

    for name, count in (("a.csv", 120), ("b.csv", 300)):
        (tmp_path / name).write_text("arrival_s,prompt_len,output_len\n" + "".join(
            f"{i / 4},{40 + i % 50},{8 + i % 9}\n" for i in range(count)))
    data = scenario(slo=OBJECTIVES, workload={"kind": "trace", "path": "a.csv"},
                    sweep={"grid": {"workload.path": ["a.csv", "b.csv"]}})
    del data["stop"]  # each file runs to its end
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(data))
    _, points = capacity_points(path)
    assert [p.scenario["stop"]["num_requests"] for p in points] == [None, None]
    _, points = capacity_points(path, quick=True)
    assert [p.scenario["stop"]["num_requests"] for p in points] == [30, 75]


def test_capacity_sweep_command_tables_figures_and_failures(tmp_path):
    path = sweep_file(tmp_path, {"grid": {"memory.kv_memory_gib": [0.000001, 2, 4]}})
    proc = kvsim_in_process("capacity", str(path), "--sweep", "--jobs", "2", "--rel-tol",
                            "0.1", "--out", str(tmp_path / "out"), "--quiet")
    assert proc.returncode == 1  # one point cannot run: recorded, the others go on
    assert proc.stderr == ("failed: SizingError: memory: the KV pool holds not one token "
                           "(llama-2-7b takes 524,288 bytes a token)\n")
    table = pd.read_parquet(tmp_path / "out" / "capacity.parquet")
    assert (table.groupby("param:memory.kv_memory_gib")["status"].first().to_dict()
            == {1e-06: "failed", 2.0: "ok", 4.0: "ok"})
    assert "capacity under SLO (req/s)" in proc.stdout
    figure = tmp_path / "out" / "figures" / "capacity_vs_memory_kv_memory_gib.png"
    assert figure.is_file()
    page = (tmp_path / "out" / "report.html").read_text()
    assert "capacity under SLO (req/s)" in page and "failed: SizingError: memory" in page
    # Which kvsim searched each point (the failed one too): one build, named on the page.
    assert (table["build"] == build_id()).all()
    assert f"<td>results made by</td><td>kvsim build {build_id()}</td>" in page
    # kvsim report draws them again from the table.
    drawn = figure.read_bytes()
    figure.unlink()
    assert kvsim_in_process("report", str(tmp_path / "out")).returncode == 0
    assert figure.read_bytes() == drawn
    refused = kvsim_in_process("capacity", str(path), "--sweep", "--ttft-s", "1", "--out",
                               str(tmp_path / "x"))
    assert refused.returncode == 2 and "put the bounds or seeds there" in refused.stderr
    # --system searches that system only, at every point, as it does without --sweep.
    one = kvsim_in_process("capacity", str(path), "--sweep", "--system", "paged", "--jobs",
                           "2", "--rel-tol", "0.1", "--out", str(tmp_path / "paged"), "--quiet")
    assert one.returncode == 1
    alone = pd.read_parquet(tmp_path / "paged" / "capacity.parquet")
    assert list(alone["system"]) == ["paged"] * 3
    both = table.set_index(["param:memory.kv_memory_gib", "system"])["capacity_req_s"]
    for pool in (2.0, 4.0):
        assert alone.set_index("param:memory.kv_memory_gib").loc[pool, "capacity_req_s"] == (
            both[(pool, "paged")])
    unknown = kvsim_in_process("capacity", str(path), "--sweep", "--system", "pagd", "--out",
                               str(tmp_path / "y"))
    assert unknown.returncode == 2
    assert "--system pagd: no such system; systems: contiguous, paged" in unknown.stderr


def test_a_sweep_whose_every_point_fails_keeps_their_errors(tmp_path):
    """No point runs: the commands still write every row and say why each failed, with
    exit code 1 and no traceback; a sweep without objectives is refused before any run."""
    path = sweep_file(tmp_path, {"grid": {"memory.kv_memory_gib": [0.000001, 0.000002]}})
    searched = kvsim_in_process("capacity", str(path), "--sweep", "--jobs", "2", "--out",
                                str(tmp_path / "cap"), "--quiet")
    assert searched.returncode == 1
    assert searched.stderr.startswith("failed: SizingError: memory: the KV pool holds not")
    table = pd.read_parquet(tmp_path / "cap" / "capacity.parquet")
    assert len(table) == 4 and (table["status"] == "failed").all()
    assert table["capacity_req_s"].isna().all()
    swept = kvsim_in_process("sweep", str(path), "--jobs", "2", "--out",
                             str(tmp_path / "runs"), "--quiet")
    assert swept.returncode == 1 and "Traceback" not in swept.stderr
    report = (tmp_path / "runs" / "report.html").read_text()
    assert report.count("SizingError: memory: the KV pool holds not one token") == 4
    import yaml

    data = yaml.safe_load(path.read_text())
    del data["slo"]
    path.write_text(yaml.safe_dump(data))
    refused = kvsim_in_process("capacity", str(path), "--sweep", "--out", str(tmp_path / "x"))
    assert refused.returncode == 2
    assert refused.stderr.strip().endswith("no slo section: capacity is the load at which "
                                           "enough requests meet an SLO, e.g. slo: "
                                           "{ttft_s: 1.0, tpot_s: 0.05}")
    assert "\n" not in refused.stderr.strip()
    # A malformed sweep section is told as kvsim sweep tells it, the file named once.
    for grid, told in (("1", "sweep: grid: expected a mapping (got '1')"),
                       ({"nope.x": [1, 2]}, "nope: unknown key [at sweep point nope.x=1]")):
        path.write_text(yaml.safe_dump({**data, "slo": OBJECTIVES, "sweep": {"grid": grid}}))
        bad = kvsim_in_process("capacity", str(path), "--sweep", "--out", str(tmp_path / "x"))
        assert bad.returncode == 2 and bad.stderr == f"kvsim: error: {path}: {told}\n"
    assert not (tmp_path / "x").exists()  # refused before any search: no folder left
    # A workload that cannot run is refused before any search too, as kvsim sweep refuses
    # it, rather than recorded as every point failing: a trace file with a bad row.
    (tmp_path / "bad.csv").write_text("arrival_s,prompt_len,output_len\n0,10,5\n1,-3,5\n")
    path.write_text(yaml.safe_dump({**data, "slo": OBJECTIVES, "stop": None,
                                    "workload": {"kind": "trace", "path": "bad.csv"},
                                    "sweep": {"grid": {"memory.kv_memory_gib": [1, 2]}}}))
    for command in (["sweep"], ["capacity", "--sweep"]):
        bad = kvsim_in_process(*command, str(path), "--out", str(tmp_path / "x"))
        assert bad.returncode == 2 and bad.stderr.count("\n") == 1, bad.stderr
        assert "bad.csv" in bad.stderr and "prompt_len" in bad.stderr
        assert not (tmp_path / "x").exists()


def test_capacity_under_several_seeds_is_each_seeds_own_search(tmp_path, capfd):
    """--seeds searches the scenario once per seed, each exactly as --seed would, and
    reports the median and the spread."""
    import functools

    from sim.capacity import capacity_by_seed
    from sim.cli import _print_probe

    data = scenario(slo={**OBJECTIVES, "attainment": 0.8})
    base = scenario_from_dict(data)
    progress = functools.partial(_print_probe, slo=data["slo"], with_seed=True)
    knob, capacities = capacity_by_seed(base, Path(), [0, 3, 5], rel_tol=0.05, jobs=2,
                                        progress=progress)
    assert [(c.system, c.seed) for c in capacities] == [
        (s, seed) for seed in (0, 3, 5) for s in ("contiguous", "paged")]
    for seed in (0, 3, 5):
        _, alone = find_capacity(scenario_from_dict({**data, "seed": seed}), Path(),
                                 rel_tol=0.05)
        assert [c for c in capacities if c.seed == seed] == alone  # every probe alike
    printed = capfd.readouterr().err.splitlines()
    assert len(printed) == sum(len(c.probes) for c in capacities)
    assert sum(line.startswith("  paged (seed 3): ") for line in printed) == len(
        capacities[3].probes)
    # Other requests, other answers: the seeds do not all agree.
    paged = [knob.offered_req_s(c.held) for c in capacities if c.system == "paged"]
    assert len(set(paged)) > 1
    _, serial = capacity_by_seed(base, Path(), [0, 3, 5], rel_tol=0.05)
    assert serial == capacities
    with pytest.raises(CapacityError, match="distinct seeds"):
        capacity_by_seed(base, Path(), [1, 1])

    proc, result = _capacity_json(tmp_path, data, "--seeds", "0,3,5")
    path = tmp_path / "s.yaml"
    assert result["seeds"] == [0, 3, 5] and "seed" not in result
    found = result["systems"]["paged"]
    assert found["capacity_req_s"] == pytest.approx(float(np.median(paged)))
    assert (found["capacity_req_s_min"], found["capacity_req_s_max"]) == (min(paged),
                                                                          max(paged))
    assert [found["by_seed"][s]["capacity_req_s"] for s in ("0", "3", "5")] == paged
    line = next(x for x in proc.stdout.splitlines() if x.startswith("  paged"))
    assert f"median {float(np.median(paged)):,.4g} req/s over 3 seeds" in line
    # The runs shown at capacity are the median seed's (the first of seeds alike).
    middle = [0, 3, 5][paged.index(sorted(paged)[1])]
    assert f"paged (seed {middle})" in proc.stdout
    probes = pd.read_csv(tmp_path / "out" / "probes.csv")
    assert sorted(probes["seed"].unique()) == [0, 3, 5]
    # The figure: a line for each seed searched, each with its own capacity.
    from reports.capacity_report import capacity_figure

    figure = capacity_figure(probes, result)
    labels = [line.get_label() for line in figure.axes[0].get_lines()
              if not line.get_label().startswith("_")]
    assert labels == [f"paged, seed {seed} (capacity {capacity:.3g})"
                      for seed, capacity in zip((0, 3, 5), paged, strict=True)]
    assert len(probes) == sum(found["by_seed"][s]["runs"] for s in ("0", "3", "5"))
    for args in (["--seeds", "1,1"], ["--seeds", "1,x"], ["--seeds", "0,1", "--seed", "2"]):
        bad = kvsim_in_process("capacity", str(path), "--out", str(tmp_path / "x"), *args)
        assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith(
            "kvsim: error: argument --seed")


def test_per_gpu_capacity_is_shown_where_gpu_counts_differ():
    from sim.metrics import sweep_metrics

    table = pd.DataFrame({"gpus": [1, 2], "capacity_req_s": [1.0, 2.0],
                          "capacity_req_s_per_gpu": [1.0, 1.0]})
    assert sweep_metrics(table, ["capacity_req_s"]) == ["capacity_req_s",
                                                        "capacity_req_s_per_gpu"]
    assert sweep_metrics(table.assign(gpus=2), ["capacity_req_s"]) == ["capacity_req_s"]
    assert sweep_metrics(table.assign(capacity_req_s=np.nan), ["capacity_req_s"]) == []


def test_the_python_api_finds_what_the_command_finds(tmp_path):
    import sim

    data = scenario(slo=OBJECTIVES)
    table = sim.capacity_under_slo(data, rel_tol=0.05, systems=["paged"], seed=3)
    _, (paged,) = find_capacity(scenario_from_dict({**data, "seed": 3}), Path(),
                                rel_tol=0.05, systems=["paged"])
    assert list(table.index) == ["paged"]
    assert table.loc["paged", "capacity_req_s"] == paged.held
    assert table.loc["paged", "slo_attainment"] == paged.at(paged.held).attainment
    assert table.loc["paged", "runs"] == len(paged.probes)

    _, result = _capacity_json(tmp_path, data, "--seed", "3")
    path = tmp_path / "s.yaml"
    assert result["seed"] == 3
    assert result["systems"]["paged"]["capacity_req_s"] == paged.held
    # Under several seeds: a row per system and seed, the seed 3 row the search above.
    by_seed = sim.capacity_under_slo(data, rel_tol=0.05, systems=["paged"], seeds=[1, 3],
                                     jobs=2)
    assert list(by_seed.index) == [("paged", 1), ("paged", 3)]
    assert by_seed.loc[("paged", 3)].equals(table.loc["paged"])
    # Kept runs, read back by a second call: the same table.
    kept = [sim.capacity_under_slo(data, rel_tol=0.05, systems=["paged"], seeds=[1, 3],
                                   jobs=2, probe_dir=tmp_path / "probes") for _ in range(2)]
    assert len(list((tmp_path / "probes").iterdir())) == by_seed["runs"].sum()
    for again in kept:
        pd.testing.assert_frame_equal(again, by_seed)
    with pytest.raises(ValueError, match="seed or seeds"):
        sim.capacity_under_slo(data, seed=1, seeds=[1, 2])
    with pytest.raises(CapacityError, match="distinct seeds, got"):
        sim.capacity_under_slo(data, seeds=[])
    # --seeds with one seed is --seed: its file names that seed.
    one = kvsim_in_process("capacity", str(path), "--system", "paged", "--rel-tol", "0.05",
                           "--seeds", "3", "--out", str(tmp_path / "one"), "--quiet")
    assert one.returncode == 0, one.stderr
    assert json.loads((tmp_path / "one" / "capacity.json").read_text()) == result


def test_a_capacity_measured_before_the_run_settles_is_told_so(tmp_path):
    from sim.capacity import unsettled_note

    # 100 requests over 2 s served in 10 s: a burst; over 8 s served in 10 s: a rate.
    note = unsettled_note("paged", 100, 50.0, 10.0)
    assert note is not None and note.startswith(
        "paged: at its capacity its 100 requests arrive over about 2.0 s and take 10.0 s")
    assert unsettled_note("paged", 100, 12.5, 10.0) is None
    import yaml

    # Forty requests, long to decode: the search finds the rate at which the queue holds
    # them all within the SLO at once.
    few = scenario(slo={"ttft_s": 5.0, "tpot_s": 0.2}, stop={"num_requests": 40})
    few["systems"] = few["systems"][1:]
    path = tmp_path / "few.yaml"
    path.write_text(yaml.safe_dump(few))
    printed = kvsim_in_process("capacity", str(path), "--rel-tol", "0.2", "--quiet",
                               "--out", str(tmp_path / "cap"))
    assert printed.returncode == 0, printed.stderr
    assert "note (at capacity): paged: at its capacity its 40 requests arrive over" in (
        printed.stdout)
    many = dict(few, stop={"num_requests": 600})
    path.write_text(yaml.safe_dump(many))
    printed = kvsim_in_process("capacity", str(path), "--rel-tol", "0.2", "--quiet",
                               "--out", str(tmp_path / "cap2"))
    assert printed.returncode == 0 and "not a steady state" not in printed.stdout
