"""lm-evaluation-harness against a 1P+1D cluster's HTTP API, as its users run it: its ``local-completions``
model (completions with ``echo`` and ``logprobs``, prompts as token-id lists, several per request at
``batch_size`` > 1) gives the per-example log-likelihoods and generations of lm-eval's own ``hf`` backend on the
bundled model (fp32). The tasks' data ship in ``tests/support/lm_eval``; nothing downloads."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest
from cluster_utils import cluster, discard

lm_eval = pytest.importorskip("lm_eval")

DATA = Path(__file__).resolve().parents[1] / "support" / "lm_eval"
# fp32 on both sides; the cluster computes each prompt in chunks over a paged cache, transformers whole: the
# sum of a continuation's few log-probabilities differs by summation order only (tests/engine/test_logprobs.py)
TOLERANCE = 1e-4

MC_TASK = """task: kvserve_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}/tiny_mc.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: " "
metric_list:
  - metric: acc
"""
GEN_TASK = """task: kvserve_tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}/tiny_gen.jsonl
test_split: test
output_type: generate_until
doc_to_text: "Q: {{{{question}}}}\\nA:"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 16
  do_sample: false
metric_list:
  - metric: exact_match
"""
TASKS = ["kvserve_tiny_mc", "kvserve_tiny_gen"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    c = cluster(1, 1, tmp_path_factory.mktemp("logs-lm-eval"), http=True)
    with urllib.request.urlopen(f"{c.http_endpoint}/v1/models", timeout=30) as reply:
        c.model_name = json.loads(reply.read())["data"][0]["id"]
    yield c
    discard(c)


@pytest.fixture(scope="module")
def task_manager(tmp_path_factory, monkeypatch_module):
    tasks = tmp_path_factory.mktemp("lm-eval-tasks")
    (tasks / "tiny_mc.yaml").write_text(MC_TASK.format(data=DATA))
    (tasks / "tiny_gen.yaml").write_text(GEN_TASK.format(data=DATA))
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(tasks))


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_DATASETS_OFFLINE", "1")
        patch.setenv("HF_HUB_OFFLINE", "1")
        yield patch


def _samples(results) -> dict[str, list]:
    """Task -> each document's responses, in document order."""
    return {task: [s["resps"] for s in sorted(samples, key=lambda s: s["doc_id"])]
            for task, samples in results["samples"].items()}  # fmt: skip


@pytest.fixture(scope="module")
def reference(task_manager, model_dir):
    hf_args = {"pretrained": str(model_dir), "dtype": "float32", "device": "cpu"}
    results = lm_eval.simple_evaluate(model="hf", model_args=hf_args, tasks=TASKS, task_manager=task_manager,
                                      batch_size=1, log_samples=True)  # fmt: skip
    return _samples(results)


# on demand (pytest -m soak), outside make test's 15 minutes (about 80 s): the protocol it uses (echo, logprobs,
# prompt lists, n) is tested in tests/service/test_openai_logprobs.py and test_parallel_sampling_api.py
@pytest.mark.soak
@pytest.mark.parametrize("batch_size", [1, 4])
def test_local_completions_give_the_hf_backends_loglikelihoods_and_generations(served, task_manager, model_dir,
                                                                               reference, batch_size):  # fmt: skip
    model_args = {"base_url": f"{served.http_endpoint}/v1/completions", "model": served.model_name,
                  "tokenizer_backend": "huggingface", "tokenizer": str(model_dir), "tokenized_requests": True,
                  "num_concurrent": 1, "max_retries": 1}  # fmt: skip
    results = lm_eval.simple_evaluate(model="local-completions", model_args=model_args, tasks=TASKS,
                                      task_manager=task_manager, batch_size=batch_size, log_samples=True)  # fmt: skip
    got = _samples(results)
    mc, want_mc = got["kvserve_tiny_mc"], reference["kvserve_tiny_mc"]
    assert len(mc) == len(want_mc) == 8
    for doc, want_doc in zip(mc, want_mc, strict=True):
        assert len(doc) == len(want_doc) == 4
        for [(ll, greedy)], [(want_ll, want_greedy)] in zip(doc, want_doc, strict=True):
            assert abs(ll - want_ll) < TOLERANCE, (ll, want_ll)
            assert greedy == want_greedy
    assert got["kvserve_tiny_gen"] == reference["kvserve_tiny_gen"]
