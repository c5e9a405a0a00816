"""How `make bench` judges issue 22's bar (bench/bench_ramps.py `bar_lines`), on rows a real run
printed (2026-12-03, the emulated engines): a fast predict run that is inconclusive, or less
certain than the prediction-free ramp, is no speed-up."""

from __future__ import annotations

from bench.bench_ramps import SHAPES, bar_lines, medians, pick, wrong_prediction


def row(shape: str, strategy: str, lifetimes: float, verdict: str, uncertainty: float) -> dict:
    return {"shape": shape, "strategy": strategy, "lifetimes": lifetimes, "verdict": verdict,
            "uncertainty": uncertainty}


def shapes(*names: str):
    return [s for s in SHAPES if s.name in names]


def test_a_right_prediction_must_be_twice_as_fast_at_the_same_verdict_and_certainty():
    runs = [row("vllm knee~24", "predict", 9.18, "PASS", 0.76), row("vllm knee~24", "doubling", 17.99, "PASS", 0.85),
            row("vllm knee~24", "bisect", 30.0, "PASS", 0.43)]
    lines = bar_lines(runs, shapes("vllm knee~24"))
    assert lines[0].startswith("vllm knee~24: predict 9.2 lifetimes (PASS), best prediction-free (doubling) 18.0")
    assert "1.96x" in lines[0] and "misses the bar" in lines[0] and lines[-1].startswith("the bar: not met")
    runs[0]["lifetimes"] = 8.9
    assert bar_lines(runs, shapes("vllm knee~24"))[-1].startswith("the bar: met")


def test_an_inconclusive_or_less_certain_predict_run_is_no_speed_up():
    runs = [row("vllm knee~4", "predict", 3.52, "INCONCLUSIVE", 0.13),
            row("vllm knee~4", "doubling", 18.01, "PASS", 0.06),
            row("sglang knee~50", "predict", 5.84, "PASS", 0.82), row("sglang knee~50", "doubling", 18.0, "PASS", 0.09),
            row("sglang knee~50", "bisect", 45.0, "INCONCLUSIVE", 0.04)]
    lines = bar_lines(runs, shapes("vllm knee~4", "sglang knee~50"))
    assert "not comparable: predict INCONCLUSIVE, doubling PASS" in lines[0] and "misses the bar" in lines[0]
    # bisect was inconclusive: the comparison is with doubling, whose ± 0.09 is narrower than predict's
    assert "(doubling) 18.0" in lines[1] and "is wider than ± 0.09" in lines[1]
    assert lines[-1].startswith("the bar: not met")


def test_a_wrong_prediction_may_be_slower_but_must_be_conclusive():
    name = "vllm knee~24, predicted x0.5"
    runs = [row(name, "predict", 16.0, "FAIL", 0.63), row(name, "doubling", 18.0, "FAIL", 0.38)]
    assert bar_lines(runs, shapes(name))[-1].startswith("the bar: met")
    runs[0].update(lifetimes=28.0)  # 1.75x slower than the search
    assert "misses the bar" in bar_lines(runs, shapes(name))[0]
    runs[0].update(lifetimes=16.0, verdict="INCONCLUSIVE")
    assert bar_lines(runs, shapes(name))[-1].startswith("the bar: not met")


def test_a_wrong_prediction_is_wrong_in_the_figure_the_check_judges():
    # a reservation engine's check reads the time average beside the limit: scaling the limit alone
    # left the x2 and x0.5 shapes judged against the right prediction (both PASSED on 2026-12-07)
    from kvprobe.theory.ledger.build import LedgerInputs, build_ledger
    from kvprobe.theory.prediction import judged_plateau

    ledger = build_ledger(LedgerInputs(engine="sglang", model="meta-llama/Llama-3.1-8B", max_total_tokens=3300,
                                       context_length=2048, prompt_tokens=32, output_tokens=256))
    adm = ledger.admission
    assert adm.limit_mean is not None and adm.limit_mean != adm.limit
    doubled = wrong_prediction(ledger, 2.0).admission
    assert judged_plateau(doubled) == 2 * judged_plateau(adm) and doubled.limit == 2 * adm.limit
    assert doubled.no_preemption_limit == 2 * adm.no_preemption_limit


def test_repeated_runs_are_compared_by_their_medians():
    # three draws of doubling's ± at knee~24 on one day (0.29, 0.42, 0.51): the bar reads the median one
    runs = [row("vllm knee~24", "doubling", 18.0, "PASS", u) for u in (0.51, 0.29, 0.42)]
    runs += [row("vllm knee~24", "predict", t, v, u) for t, v, u in ((7.1, "PASS", 0.44), (8.3, "PASS", 0.40),
                                                                     (13.9, "INCONCLUSIVE", 0.25))]
    summary = medians(runs)
    assert [(m["strategy"], m["runs"]) for m in summary] == [("doubling", 3), ("predict", 3)]
    free, mine = summary
    assert free["uncertainty"] == 0.42 and free["lifetimes"] == 18.0 and free["verdict"] == "PASS"
    assert mine["lifetimes"] == 8.3 and mine["uncertainty"] == 0.40
    assert mine["verdict"] == "PASS" and mine["verdicts"] == ["PASS", "PASS", "INCONCLUSIVE"]
    line = bar_lines(summary, shapes("vllm knee~24"))[0]
    assert "predict 8.3 lifetimes (PASS)" in line and "2.17x" in line and "misses" not in line
    # one draw alone would have compared predict's 0.44 with doubling's luckiest 0.29
    assert "wider than ± 0.29" in bar_lines([runs[1], runs[3]], shapes("vllm knee~24"))[0]


def test_a_shape_named_whole_is_picked_alone():
    assert [s.name for s in pick(SHAPES, "vllm knee~24")] == ["vllm knee~24"]
    assert len(pick(SHAPES, "knee~24")) == 3 and [s.name for s in pick(SHAPES, "x2, sglang knee~12")] == [
        "sglang knee~12", "vllm knee~24, predicted x2"]
