"""CPU tests of `bench serve --goodput` and the per-rate GC pauses: the sweep as a pure function with a
fake probe, the GC-pause delta of two /metrics texts, the serve table, and the command end to end."""

import json

import pytest

from tokenmill.bench import report
from tokenmill.bench.serve import gc_pauses, goodput_search, goodput_verdict
from tokenmill.entrypoints.cli import main


# ---- the sweep ------------------------------------------------------------------------------------

def _threshold(limit):
    return lambda rate: rate <= limit


def test_search_finds_the_boundary_of_a_monotone_probe():
    best, probed = goodput_search(_threshold(50.0), start=8.0, rounds=3)
    # 8, 16, 32 pass, 64 fails; then 48 (pass), 56 (fail), 52 (fail)
    assert [r for r, _ in probed] == [8.0, 16.0, 32.0, 64.0, 48.0, 56.0, 52.0]
    assert [ok for _, ok in probed] == [True, True, True, False, True, False, False]
    assert best == 48.0
    assert all(ok == (r <= 50.0) for r, ok in probed)  # each rate probed once, with the probe's answer


def test_search_converges_with_more_rounds():
    best, probed = goodput_search(_threshold(50.0), start=8.0, rounds=12)
    assert 49.0 < best <= 50.0
    assert len({r for r, _ in probed}) == len(probed)
    best, _ = goodput_search(_threshold(50.0), start=8.0, rounds=0)
    assert best == 32.0  # no bisection: the last rate of the doubling that passed


def test_search_returns_none_when_the_first_rate_fails():
    best, probed = goodput_search(_threshold(0.0), start=8.0)
    assert best is None and probed == [(8.0, False)]


def test_search_stops_at_the_max_rate():
    best, probed = goodput_search(_threshold(1e9), start=8.0, max_rate=100.0)
    assert best == 100.0 and [r for r, _ in probed] == [8.0, 16.0, 32.0, 64.0, 100.0]
    best, probed = goodput_search(_threshold(1e9), start=1.0)  # default cap: 64 x start
    assert best == 64.0 and probed[-1] == (64.0, True) and len(probed) == 7
    best, probed = goodput_search(_threshold(70.0), start=8.0, max_rate=100.0, rounds=1)
    assert [r for r, _ in probed] == [8.0, 16.0, 32.0, 64.0, 100.0, 82.0] and best == 64.0


def test_search_refuses_an_infinite_start():
    for bad in (0.0, -1.0, float("inf")):
        with pytest.raises(ValueError):
            goodput_search(_threshold(1.0), start=bad)


def test_verdict():
    ok = {"failed": 0, "itl_ms_p99": 29.0, "ttft_ms_p99": 900.0}
    assert goodput_verdict(ok, 30.0, 1000.0) == []
    assert goodput_verdict({**ok, "itl_ms_p99": 31.0}, 30.0, 1000.0) == ["ITL p99 31.0 ms > 30 ms"]
    assert goodput_verdict({**ok, "ttft_ms_p99": 1500.0, "failed": 2}, 30.0, 1000.0) == [
        "2 requests failed", "TTFT p99 1500.0 ms > 1000 ms"]
    assert goodput_verdict({**ok, "itl_ms_p99": None}, 30.0, 1000.0) == ["no ITL p99 measured"]


# ---- the GC pauses of a rate ----------------------------------------------------------------------

def _gc_scrape(per_generation: dict, name: str = "tokenmill:gc_pause_seconds") -> str:
    """A /metrics text with a GC histogram: {generation: ([(le, cumulative count)...], sum)}."""
    lines = [f"# HELP {name} Python garbage-collection pauses, by generation.", f"# TYPE {name} histogram"]
    for gen, (buckets, total) in per_generation.items():
        for le, c in buckets:
            lines.append(f'{name}_bucket{{generation="{gen}",le="{le}",model_name="m"}} {c}')
        lines.append(f'{name}_count{{generation="{gen}",model_name="m"}} {buckets[-1][1]}')
        lines.append(f'{name}_sum{{generation="{gen}",model_name="m"}} {total}')
    lines.append('tokenmill:engine_steps_total{model_name="m"} 7.0')
    return "\n".join(lines) + "\n"


def test_gc_pauses_between_two_scrapes():
    before = _gc_scrape({"0": ([("0.001", 50.0), ("0.01", 50.0), ("0.05", 50.0), ("+Inf", 50.0)], 0.01),
                         "2": ([("0.001", 0.0), ("0.01", 1.0), ("0.05", 1.0), ("+Inf", 1.0)], 0.008)})
    # three more gen-2 pauses: 6 ms, 9 ms and 40 ms (sum 0.055); gen 0 moves too but is not counted
    after = _gc_scrape({"0": ([("0.001", 90.0), ("0.01", 90.0), ("0.05", 90.0), ("+Inf", 90.0)], 0.02),
                        "2": ([("0.001", 0.0), ("0.01", 3.0), ("0.05", 4.0), ("+Inf", 4.0)], 0.063)})
    g = gc_pauses(before, after)
    assert g == {"count": 3, "mean_ms": pytest.approx(55.0 / 3), "max_le_ms": pytest.approx(50.0)}
    assert gc_pauses(before, after, "0")["count"] == 40 and gc_pauses(before, after, "0")["max_le_ms"] == 1.0
    # none in the window, none ever, no GC histogram at all, a scrape missing
    assert gc_pauses(after, after) == {"count": 0, "mean_ms": None, "max_le_ms": None}
    assert gc_pauses(_gc_scrape({}), _gc_scrape({})) == {"count": 0, "mean_ms": None, "max_le_ms": None}
    assert gc_pauses('tokenmill:engine_steps_total{model_name="m"} 1.0', 'tokenmill:engine_steps_total{model_name="m"} 2.0') is None
    assert gc_pauses(None, after) is None
    # the first gen-2 pause of the server's life: no series before, one after
    first = gc_pauses(_gc_scrape({}), _gc_scrape({"2": ([("0.01", 0.0), ("0.05", 1.0), ("+Inf", 1.0)], 0.03)}))
    assert first == {"count": 1, "mean_ms": pytest.approx(30.0), "max_le_ms": pytest.approx(50.0)}
    # an engine process's own histogram, where a server exports one: read apart from the server's
    engine = "tokenmill:engine_gc_pause_seconds"
    e_before = before + _gc_scrape({"2": ([("0.01", 0.0), ("+Inf", 0.0)], 0.0)}, engine)
    e_after = after + _gc_scrape({"2": ([("0.01", 0.0), ("+Inf", 2.0)], 0.5)}, engine)
    assert gc_pauses(e_before, e_after, "2", engine) == {"count": 2, "mean_ms": pytest.approx(250.0),
                                                         "max_le_ms": float("inf")}
    assert gc_pauses(e_before, e_after) == g and gc_pauses(before, after, "2", engine) is None


# ---- the serve table ------------------------------------------------------------------------------

def _entry(rate, tok_s, ttft99, itl50, itl99, mixed=None, gc=None, server=True):
    steps = {"decode": {"count": 9, "mean_ms": 10.0, "p50_le_ms": 10.0, "p99_le_ms": 15.0, "max_le_ms": 20.0}}
    if mixed:
        steps["mixed"] = {"count": 4, "mean_ms": mixed[0], "p50_le_ms": mixed[1], "p99_le_ms": mixed[1],
                          "max_le_ms": mixed[1]}
    return {"request_rate": rate, "summary": {"output_tok_per_s": tok_s, "ttft_ms_p99": ttft99, "itl_ms_p50": itl50,
                                              "itl_ms_p99": itl99, "failed": 0},
            "server_steps": steps if server else None, "server_side": {"steps": steps} if server else None,
            "gc_gen2": gc}


def test_serve_table():
    result = {"kind": "serve", "rates": [
        _entry(8.0, 2400.0, 120.4, 11.04, 24.96, mixed=(18.25, 25.0), gc={"count": 0, "mean_ms": None, "max_le_ms": None}),
        _entry(16.0, 4100.0, 310.0, 12.0, 41.0, mixed=(22.0, None),
               gc={"count": 2, "mean_ms": 31.5, "max_le_ms": 40.0}),
        _entry("inf", 5000.0, None, None, None, server=False)]}
    assert report.serve_table(result) == "\n".join([
        "| rate | output tok/s | TTFT p99 | ITL p50/p99 | mixed steps mean/p99 | GC gen-2 pauses |",
        "|---|---|---|---|---|---|",
        "| 8 | 2400 | 120 ms | 11.0 / 25.0 ms | 18.2 / <= 25 ms | 0 |",
        "| 16 | 4100 | 310 ms | 12.0 / 41.0 ms | 22.0 / <= inf ms | 2, mean 31.5 ms, max <= 40 ms |",
        "| inf | 5000 | - ms | - / - ms | - | - |"])
    # a decode-only load: no mixed steps
    assert report.serve_table_row(_entry(4.0, 10.0, 1.0, 1.0, 1.0))[4] == "none"
    # a server with an engine process of its own: both processes' pauses
    two = dict(_entry(4.0, 10.0, 1.0, 1.0, 1.0, gc={"count": 0}),
               engine_gc_gen2={"count": 1, "mean_ms": 12.0, "max_le_ms": 15.0})
    assert report.serve_table_row(two)[5] == "server 0; engine 1, mean 12.0 ms, max <= 15 ms"


def test_serve_table_with_goodput(tmp_path, capsys):
    probes = [dict(_entry(8.0, 2400.0, 120.0, 11.0, 25.0), passed=True, fail_reasons=[]),
              dict(_entry(16.0, 4100.0, 310.0, 12.0, 41.0), passed=False, fail_reasons=["ITL p99 41.0 ms > 30 ms"]),
              dict(_entry(12.0, 3300.0, 200.0, 11.5, 29.0), passed=True, fail_reasons=[])]
    result = {"kind": "serve", "workload": {"name": "serve-8b"}, "rates": [],
              "goodput": {"goodput_req_per_s": 12.0, "note": None, "itl_p99_ms_max": 30.0, "ttft_p99_ms_max": 1000.0,
                          "probes": probes}}
    table = report.serve_table(result)
    lines = table.splitlines()
    assert lines[0] == "| rate | output tok/s | TTFT p99 | ITL p50/p99 | mixed steps mean/p99 | GC gen-2 pauses | goodput |"
    assert lines[2].endswith("| pass |") and lines[3].endswith("| fail: ITL p99 41.0 ms > 30 ms |")
    assert lines[-1] == "goodput (ITL p99 <= 30 ms, TTFT p99 <= 1000 ms): 12 req/s"
    none = report.serve_table({"goodput": {**result["goodput"], "goodput_req_per_s": None, "note": "even the first"}})
    assert none.splitlines()[-1].endswith(": none (even the first)")
    # the summary table's goodput row, and the serve-table command on a file
    rows = report.summary_rows({"results": [result]})
    assert "goodput 12 req/s" in rows[-1][6] and rows[-1][3] == "3300"  # the output rate at the goodput
    path = report.write_json(result, str(tmp_path / "serve.json"))
    assert report.main(["serve-table", path]) == 0
    assert capsys.readouterr().out.strip() == table
    other = report.write_json({"kind": "latency"}, str(tmp_path / "lat.json"))
    assert report.main(["serve-table", other]) == 1


# ---- end to end -----------------------------------------------------------------------------------

def test_goodput_against_a_fake_server_that_misses_the_target(tmp_path):
    pytest.importorskip("aiohttp")
    from tests.bench.test_bench_cpu import _FakeServer

    server = _FakeServer()
    try:
        rc = main(["bench", "serve", "--workload", "tiny", "--device", "cpu", "--base-url",
                   f"http://127.0.0.1:{server.port}", "--goodput", "--goodput-start", "50", "--goodput-requests", "3",
                   "--goodput-itl-p99-ms", "0.001", "--out", str(tmp_path), "--no-plot"])
    finally:
        server.close()
    assert rc == 0
    r = json.loads((tmp_path / "serve-tiny.json").read_text())
    g = r["goodput"]
    assert r["rates"] == [] and g["goodput_req_per_s"] is None and r["summary"]["goodput_req_per_s"] is None
    assert "even the first rate" in g["note"] and len(g["probes"]) == 1
    (probe,) = g["probes"]
    assert probe["request_rate"] == 50.0 and probe["passed"] is False and probe["num_requests"] == 3
    assert probe["fail_reasons"][0].startswith("ITL p99") and probe["gc_gen2"] is None  # the fake has no /metrics


def test_goodput_refuses_a_rate_it_cannot_start_from(tmp_path):
    with pytest.raises(SystemExit, match="finite start rate"):
        main(["bench", "serve", "--workload", "tiny", "--device", "cpu", "--base-url", "http://127.0.0.1:9",
              "--goodput", "--out", str(tmp_path)])


def test_rates_and_goodput_against_the_real_server(tmp_path, capsys):
    """A rate sweep, then the goodput search on the same launched server (loose targets: the tiny model
    on a shared CPU passes them at every rate, so the search runs up to its cap)."""
    pytest.importorskip("fastapi")
    pytest.importorskip("aiohttp")
    rc = main(["bench", "serve", "--workload", "tiny", "--device", "cpu", "--launch", "--num-prompts", "4",
               "--output-len", "4:8", "--rates", "20,inf", "--goodput", "--goodput-start", "10",
               "--goodput-max-rate", "20", "--goodput-requests", "3", "--goodput-itl-p99-ms", "60000",
               "--goodput-ttft-p99-ms", "60000", "--warmup-requests", "1", "--out", str(tmp_path),
               "--server-timeout", "120", "--no-plot"])
    assert rc == 0
    r = json.loads((tmp_path / "serve-tiny+custom.json").read_text())
    assert [x["request_rate"] for x in r["rates"]] == [20.0, "inf"]
    for entry in r["rates"]:
        gc = entry["gc_gen2"]  # the server exports its GC histogram: a count, 0 when no gen-2 collection ran
        assert gc is not None and gc["count"] >= 0 and (gc["count"] == 0) == (gc["max_le_ms"] is None)
        assert entry["server_steps"]["decode"]["max_le_ms"] >= entry["server_steps"]["decode"]["p99_le_ms"]
    g = r["goodput"]
    assert g["goodput_req_per_s"] == 20.0 and "cap" in g["note"]
    assert [(p["request_rate"], p["passed"], p["num_requests"]) for p in g["probes"]] == [(10.0, True, 3), (20.0, True, 3)]
    assert all(p["summary"]["completed"] == 3 and p["output_tok_per_s"] > 0 for p in g["probes"])
    assert r["summary"]["goodput_req_per_s"] == 20.0
    out = capsys.readouterr().out
    assert "| rate | output tok/s | TTFT p99 | ITL p50/p99 | mixed steps mean/p99 | GC gen-2 pauses |" in out
    assert "goodput (ITL p99 <= 60000 ms, TTFT p99 <= 60000 ms): 20 req/s" in out
