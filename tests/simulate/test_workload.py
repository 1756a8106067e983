"""Workload files: what they say becomes the same arrivals for the same seed, and a mistake is
reported with the field that holds it."""

from __future__ import annotations

import pytest

from simulate.workload import WorkloadError, arrivals, load, parse

GOOD = {
    "duration_s": 60,
    "seed": 3,
    "classes": [
        {"name": "alerts", "priority": 10, "rate_per_s": 0.5, "prompt_tokens": 30, "max_tokens": {"dist": "uniform", "low": 4, "high": 8}},
        {"name": "battery", "priority": -5, "at_s": [0, 0, 1.5], "prompt_tokens": {"dist": "lognormal", "median": 300, "max": 900},
         "max_tokens": 100, "queue_timeout_s": 20},
    ],
    "requests": [{"at_s": 2.0, "priority": 3, "prompt_tokens": 1500, "max_tokens": 4}],
}


def test_the_same_file_and_seed_give_the_same_arrivals_and_another_seed_others():
    first, again = arrivals(parse(GOOD)), arrivals(parse(GOOD))
    assert first == again
    assert [a.at_ms for a in first] == sorted(a.at_ms for a in first)
    battery = [a for a in first if a.name == "battery"]
    assert [a.at_ms for a in battery] == [0, 0, 1500] and all(1 <= a.prompt_tokens <= 900 for a in battery)
    assert all(a.queue_timeout_ms == 20_000 for a in battery)
    assert [(a.at_ms, a.priority, a.prompt_tokens, a.max_tokens) for a in first if a.name == "recorded"] == [(2000, 3, 1500, 4)]
    alerts = [a for a in first if a.name == "alerts"]
    assert 10 <= len(alerts) <= 60 and all(4 <= a.max_tokens <= 8 and a.at_ms < 60_000 for a in alerts)
    assert arrivals(parse(GOOD), seed=4) != first
    assert len({a.id for a in first}) == len(first)


@pytest.mark.parametrize("change, field", [
    (lambda w: w["classes"][0].update(rate_per_s=-1), "classes.0.rate_per_s"),
    (lambda w: w["classes"][1].pop("prompt_tokens"), "classes.1.prompt_tokens"),
    (lambda w: w["classes"][0].update(at_s=[1.0]), "classes.0: give exactly one of rate_per_s, at_s, trace"),
    (lambda w: w["classes"][0].update(max_tokens={"dist": "uniform", "low": 9, "high": 3}), "classes.0.max_tokens: low must not exceed high"),
    (lambda w: w["classes"][1].update(prompt_tokens={"dist": "lognormal"}), "classes.1.prompt_tokens: dist lognormal needs median"),
    (lambda w: w["classes"][0].update(rate=3), "classes.0.rate"),
    (lambda w: w["requests"][0].update(max_tokens=0), "requests.0.max_tokens"),
    (lambda w: w.pop("duration_s"), "duration_s is needed"),
])
def test_a_mistake_names_its_field(change, field):
    import copy

    bad = copy.deepcopy(GOOD)
    change(bad)
    with pytest.raises(WorkloadError) as error:
        parse(bad)
    assert field in str(error.value)


def test_files_yaml_json_and_traces(tmp_path):
    (tmp_path / "times.txt").write_text("0.5\n1.25\n")
    (tmp_path / "w.yaml").write_text("classes:\n  - name: t\n    trace: times.txt\n    prompt_tokens: 10\n    max_tokens: 2\n")
    assert [a.at_ms for a in arrivals(load(tmp_path / "w.yaml"))] == [500, 1250]
    (tmp_path / "bad.yaml").write_text("classes: [name: t\n")
    with pytest.raises(WorkloadError, match="bad.yaml: not valid YAML"):
        load(tmp_path / "bad.yaml")
    (tmp_path / "w.json").write_text('{"classes": [{"name": "t", "trace": "missing.txt", "prompt_tokens": 1, "max_tokens": 1}]}')
    with pytest.raises(WorkloadError, match="classes.0.trace"):
        load(tmp_path / "w.json")
    (tmp_path / "r.jsonl").write_text('{"at_s": 0, "prompt_tokens": 5, "max_tokens": 2}\n{"at_s": 1, "prompt_tokens": 0, "max_tokens": 2}\n')
    (tmp_path / "r.yaml").write_text("requests_file: r.jsonl\n")
    with pytest.raises(WorkloadError, match="requests_file: .*r.jsonl line 2: prompt_tokens"):
        load(tmp_path / "r.yaml")
