"""acl/forgetting.py: a domain's cell, paired differences with their standard errors, the accuracy matrix of a
sequential run (gain, forgetting, BWT, FWT), its tables and heatmap, on hand-made evaluation records."""
import math
import os
import statistics

import pytest

from acl import forgetting


def record(values, ids=None, gold=None):
    ids = ids or [f"t{i}" for i in range(len(values))]
    b = {"mean": sum(values) / len(values), "std": 0.0, "n": len(values), "task_ids": ids, "per_task": values}
    if gold is not None:
        b["gold"] = {"loglik": sum(gold) / len(gold), "task_ids": ids, "per_task_loglik": gold}
    return {"math/test": b}


def test_paired_difference_and_matrix_standard_errors():
    x = forgetting.domain_cell(record([0, 1, 0, 1]), "math")
    y = forgetting.domain_cell(record([1, 1, 0, 1]), "math")
    d, se = forgetting.paired_difference(x, y)
    assert d == pytest.approx(0.25) and se == pytest.approx(0.25)     # diffs 1,0,0,0: sd 0.5 / sqrt 4
    # other tasks cannot be paired: the difference of means, no SE
    z = forgetting.domain_cell(record([1, 1, 1, 1], ids=["u0", "u1", "u2", "u3"]), "math")
    assert forgetting.paired_difference(x, z) == (pytest.approx(0.5), None)
    base = record([0, 0, 0, 0], gold=[-3.0, -3.0, -3.0, -3.0])
    s1 = record([1, 1, 0, 1], gold=[-1.0, -1.2, -1.1, -0.9])
    s2 = record([0, 1, 0, 0], gold=[-2.0, -2.0, -2.5, -1.5])
    stages = [("seq-1-math", "math", s1), ("seq-2-if", "if", s2)]
    m = forgetting.accuracy_matrix(stages, base, ["math", "if"])
    assert m["gain"]["math"] == (pytest.approx(0.75), pytest.approx(0.25))
    assert m["forgetting"]["math"] == pytest.approx(0.5) and m["bwt"] == pytest.approx(-0.5)
    assert m["forgetting_se"]["math"] == pytest.approx(math.sqrt(1 / 3) / 2)   # diffs 1,0,0,1
    assert m["bwt_se"] == pytest.approx(m["forgetting_se"]["math"])
    g = forgetting.accuracy_matrix(stages, base, ["math", "if"], metric="gold")
    assert g["matrix"][1][0] == pytest.approx(-1.05) and g["bwt"] == pytest.approx(-2.0 + 1.05)
    assert "±" in forgetting.matrix_table(g) and "gold log-likelihood" in forgetting.matrix_table(g)


def bench(mean):
    return {"mean": mean, "std": 0.0, "n": 10, "k": 1, "seeds": 1}


def tiny_results(**scores):
    return {f"{d}/test": bench(v) for d, v in scores.items()}


def test_accuracy_matrix_forgetting_bwt_fwt_by_hand():
    base = tiny_results(math=0.1, search=0.0, ecommerce=0.3, **{"if": 0.2})
    stages = [("seq-1-math", "math", tiny_results(math=0.5, search=0.1, ecommerce=0.3, **{"if": 0.2})),
              ("seq-2-search", "search", tiny_results(math=0.6, search=0.6, ecommerce=0.2, **{"if": 0.25})),
              ("seq-3-if", "if", {"record": 1, "benchmarks": tiny_results(math=0.2, search=0.4, ecommerce=0.1,
                                                                            **{"if": 0.9})})]
    m = forgetting.accuracy_matrix(stages, base, ["math", "search", "ecommerce", "if"])
    assert m["rows"] == ["base", "seq-1-math", "seq-2-search", "seq-3-if"]
    assert m["matrix"][2] == [0.6, 0.6, 0.2, 0.25] and m["matrix"][3][3] == 0.9
    assert m["learned"] == {"math": "seq-1-math", "search": "seq-2-search", "if": "seq-3-if"}
    # forgetting = best score at/after learning minus final: math max(.5,.6,.2)-.2, search max(.6,.4)-.4, if 0
    f = m["forgetting"]
    assert set(f) == {"math", "search", "if"}  # ecommerce was never learned
    assert f["math"] == pytest.approx(0.4) and f["search"] == pytest.approx(0.2) and f["if"] == pytest.approx(0.0)
    assert m["forgetting_mean"] == pytest.approx((0.4 + 0.2) / 2)
    # BWT: final minus just-learned, over math and search: ((.2-.5) + (.4-.6)) / 2
    assert m["bwt"] == pytest.approx(-0.25)
    # FWT: stage before learning minus base, over search and if: ((.1-0) + (.25-.2)) / 2
    assert m["fwt"] == pytest.approx(0.075)
    table = forgetting.matrix_table(m)
    assert "| seq-2-search | 0.600 | 0.600 | 0.200 | 0.250 |" in table and "BWT -0.250" in table


def test_accuracy_matrix_missing_values_and_repeats():
    stages = [("seq-1-math", "math", tiny_results(math=0.5)), ("seq-2-if", "if", tiny_results(math=0.3))]
    m = forgetting.accuracy_matrix(stages, None, ["math", "if"])
    assert m["matrix"][0] == [None, None] and m["fwt"] is None and m["bwt"] == pytest.approx(-0.2)
    assert m["forgetting"] == {"math": pytest.approx(0.2), "if": None}
    with pytest.raises(ValueError, match="learned twice"):
        forgetting.accuracy_matrix(stages + [("seq-3-math", "math", {})], None, ["math"])


def test_plot_and_tables(tmp_path):
    m = forgetting.accuracy_matrix([("seq-1-math", "math", tiny_results(math=0.5, search=0.1))],
                                 tiny_results(math=0.1), ["math", "search"])
    path = forgetting.plot_matrix(m, str(tmp_path / "eval" / "m.png"))
    assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n" and os.listdir(tmp_path / "eval") == ["m.png"]
    table = forgetting.markdown_table({"base": tiny_results(math=0.1), "seq-1-math": {
        "benchmarks": {"math/test": {"mean": 0.5, "std": 0.05}, "if/test": bench(0.2)}}})
    assert table.splitlines() == ["| checkpoint | math/test | if/test |", "|---|---|---|",
                                  "| base | 0.100 ± 0.000 | – |", "| seq-1-math | 0.500 ± 0.050 | 0.200 ± 0.000 |"]


def test_single_and_multi_hop_columns_average_their_benchmarks_per_seed():
    """The study's search columns: single-hop = mean of TriviaQA and PopQA, multi-hop = mean of HotpotQA, 2Wiki,
    MuSiQue and Bamboogle, averaged per seed (so the std is over seeds); a group with a member missing is left out."""
    bench = lambda *seeds: {"mean": sum(seeds) / len(seeds), "std": 0.0, "n": 10, "per_seed": list(seeds)}
    res = {"nq": bench(0.5, 0.5), "triviaqa": bench(0.6, 0.8), "popqa": bench(0.2, 0.2), "hotpotqa": bench(0.4, 0.2),
           "2wikimultihopqa": bench(0.3, 0.3), "musique": bench(0.1, 0.1), "bamboogle": bench(0.2, 0.4)}
    g = forgetting.group_averages(res)
    assert g["single_hop"]["per_seed"] == pytest.approx([0.4, 0.5]) and g["single_hop"]["mean"] == pytest.approx(0.45)
    assert g["single_hop"]["std"] == pytest.approx(statistics.stdev([0.4, 0.5])) and g["single_hop"]["n"] == 20
    assert g["multi_hop"]["per_seed"] == pytest.approx([0.25, 0.25]) and g["multi_hop"]["std"] == pytest.approx(0.0)
    table = forgetting.markdown_table({"ckpt": res})
    assert table.splitlines()[0].endswith("| bamboogle | single_hop | multi_hop |") and "0.450 ± 0.071" in table
    del res["popqa"]
    assert list(forgetting.group_averages(res)) == ["multi_hop"]
