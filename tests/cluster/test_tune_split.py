"""``kvserve tune --workers N``: each prefill:decode split of N workers runs as a real ``kvserve up`` cluster of
the chosen engine setting (passed to it as a ``--config`` file), measured by ``bench load``'s client down the
rate ladder; the split with the best goodput is the one written to the configuration file's ``up``."""

from __future__ import annotations

import argparse
import math

import pytest

from kvserve.bench import tune
from kvserve.bench.datasets import random_requests
from kvserve.bench.tune_output import split_workers, write_config
from kvserve.bench.tune_replay import Slo


@pytest.mark.soak  # two clusters, one after the other: on demand (pytest -m soak tests/cluster/test_tune_split.py)
def test_each_split_is_a_real_cluster_and_the_best_one_is_kept(tiny_model_dir, tmp_path, capsys):
    requests = random_requests(4, 24, 4, 0.0, 1000)
    base = {"model": str(tiny_model_dir), "device": "cpu", "skip_tokenizer_init": True}
    tuner = tune.Tuner(base, requests, Slo(30.0, 5.0), deadline=math.inf)
    tuner.rates = [0.5, 50.0]  # the ladder: the top rate first, a lower one while the SLO is missed
    chosen = {**tune.default_setting(), "max_num_seqs": 8}
    split = split_workers(argparse.Namespace(workers=2), base, chosen, requests, tuner)
    printed = capsys.readouterr().out
    assert "0 prefill + 2 decode: goodput 50 req/s" in printed and "1 prefill + 1 decode: goodput 50" in printed
    assert split == {"prefill": 0, "decode": 2}  # equal goodput: the first split measured stands
    write_config(tmp_path / "kvserve.yaml", tune.engine_options(chosen), split)
    text = (tmp_path / "kvserve.yaml").read_text()
    assert "up:\n  prefill: 0\n  decode: 2\n" in text and "max_num_seqs: 8" in text
