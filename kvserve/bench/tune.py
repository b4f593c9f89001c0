"""``kvserve tune``: the tuning table for your model, hardware and workload, and the configuration file it picks.

    kvserve tune [--model default|DIR] [--dataset random|shared-prefix|copy|jsonl] [--dataset-path F]
        [--input-len 256] [--output-len 64] [--num-requests 32] [--ttft-slo 2.0] [--tpot-slo 0.25]
        [--attainment 0.9 | --ttft-p99 S --tpot-p99 S] [--budget 10m] [--workers N] [--repeats 3]
        [--output-dir DIR]

Goodput at the SLO, as DistServe defines it: the highest request rate at which at least ``--attainment`` of the
workload's requests have a TTFT within ``--ttft-slo`` and a TPOT within ``--tpot-slo`` (``tune_replay.Slo``;
``--ttft-p99``/``--tpot-p99`` ask 99% of them). Each rate is measured by replaying the workload on an engine of
that setting (``kvserve.bench.tune_replay``: open-loop arrivals on a virtual clock driven by real engine steps).
The rates form a ladder of fractions of the default setting's capacity (the workload sent all at once). Every
rung of a search replays one arrival pattern, compressed by the rate, so latency grows with the rung, and the
goodput is found by bisection (``Tuner.search``): a rate that meets the SLO rules out every rate below it, one
that misses rules out every rate above, and a setting costs about four replays, not one per rate. Every setting
is searched on the same pattern, so two settings are compared on the same traffic.

A setting is better than another when its goodput is higher or, at equal goodput, when it stays further inside
the SLO there by more than ``TIE_MARGIN`` (``Trial.headroom``). A candidate is searched only down to the best
setting's goodput (below it, it cannot win), and one that comes out better is replayed once more at its goodput
on another arrival pattern, and so is the best: it is taken only if it stays further inside the SLO there too
(``Tuner.confirm``), so one lucky replay does not pick it.
The sweep is a coordinate descent from the default configuration, one knob at a time in this order:
``max_num_batched_tokens``, ``max_num_seqs``, block size, the KV cache dtype, prefix caching and speculative
decoding (n-gram, ``num_speculative_tokens``). Each knob's values are tried outwards from the best so far; a direction
is abandoned at its first value that is not better than the best (dominated), and the best value is kept before
the next knob. The sweep stops at ``--budget`` (say ``90s``, ``10m``, ``1h``); what it did not reach is listed.

With ``--workers N`` (N >= 2) it then splits N workers between prefill and decode: each split is a local
``kvserve up`` cluster of the best engine setting, measured with ``kvserve bench load``'s open-loop client at
the same rate ladder (real time: the ladder's top rate only, then lower ones while the SLO is missed).

Written to ``--output-dir``: ``tuning.md`` and ``tuning.json`` (per setting: goodput, the attainment, TTFT and
TPOT p50/p90/p99 at it, KV memory), ``throughput_latency.png`` (per setting, latencies against achieved
throughput), ``kv_memory.png`` (KV bytes in use against sequences running) and ``kvserve.yaml``: the chosen
configuration, for ``kvserve up --config``, a worker's ``--config`` or ``LLM(**load_config(...))``. Finally the
default and the chosen configuration are measured again side by side (``tune_output.compare``), paired: in each
of ``--repeats`` rounds both are searched on one arrival pattern of that round's own, the two sides alternating
which goes first; each round's goodputs and ratio, the medians and the median ratio are printed.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

KNOBS: list[tuple[str, list[Any]]] = [  # the scheduler's first: they decide the latencies most
    ("max_num_batched_tokens", [256, 512, 1024, 2048, 4096]),
    ("max_num_seqs", [4, 8, 16, 32, 64, 256]),
    ("block_size", [8, 16, 32]),
    ("kv_cache_dtype", ["auto", "int8"]),
    ("enable_prefix_caching", [True, False]),
    ("num_speculative_tokens", [0, 2, 4]),
]
# of the default setting's capacity: steps of 15-20% up to twice it (a slow hour can put the goodput at a
# quarter of it), and above it for the settings that raise it
RATE_FRACTIONS = (0.25, 0.3, 0.35, 0.42, 0.5, 0.6, 0.7, 0.85, 1.0, 1.15, 1.3, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 6.0)
TIE_MARGIN = 0.05  # at equal goodput, the headroom (a fraction of the SLO) a setting must gain to be better
SWEEP_SEED = 0  # the arrival pattern every setting of the sweep is searched on
CONFIRM_SEED = 1000  # the confirming replay's arrivals: a pattern of its own


@dataclass
class Trial:
    """One setting's measurements: ``goodput`` is the highest rate (requests/s) that met the SLO (0: none)."""

    setting: dict[str, Any]
    points: list = field(default_factory=list)  # tune_replay.RatePoint, in the order measured
    goodput: float = 0.0
    floor: float = 0.0  # the lowest rate searched: a goodput of 0 means "below this"
    confirmed: bool = True  # False: a goodput over the best's that a second replay did not meet

    def at_goodput(self):
        """The point at the goodput's rate; for a setting that met the SLO at no rate, its lowest rate's."""
        return next((p for p in self.points if p.rate == self.goodput), self.points[0] if self.points else None)

    def headroom(self, slo) -> float:
        """``headroom`` at the goodput's rate; -inf when no rate met the SLO. Of two settings with the same
        goodput, the one with more headroom is better."""
        point = self.at_goodput() if self.goodput else None
        return -math.inf if point is None else headroom(point, slo)

    def row(self, slo) -> dict[str, Any]:
        best = self.at_goodput()
        figures = best.summary(slo) if best is not None else {}
        shown = ("attainment", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p90_ms",
                 "tpot_p99_ms", "output_throughput", "peak_kv_bytes")
        return {"setting": self.setting, "goodput_rps": self.goodput, "searched_from_rps": self.floor,
                "confirmed": self.confirmed, **{k: figures.get(k, math.nan) for k in shown},
                "points": [p.summary(slo) for p in self.points]}  # fmt: skip


def headroom(point, slo) -> float:
    """How far inside the SLO a replay stays: 1 - the larger of TTFT's and TPOT's percentile at the attainment
    (p90 for 90%) over its bound. Negative when that percentile is past its bound."""
    q = 100 * slo.attainment
    return 1 - max(point.p("ttft", q) / slo.ttft_s, point.p("tpot", q) / slo.tpot_s)


def parse_budget(text: str) -> float:
    """Seconds of ``90s``, ``10m``, ``1h`` or a bare number of seconds; ``ValueError`` otherwise."""
    units = {"s": 1, "m": 60, "h": 3600}
    try:
        return float(text[:-1]) * units[text[-1]] if text and text[-1] in units else float(text)
    except ValueError:
        raise ValueError(f"--budget {text!r}: give seconds, or a number with s, m or h (90s, 10m, 1h)") from None


def engine_options(setting: dict[str, Any]) -> dict[str, Any]:
    """A setting as ``LLMEngine``/``EngineConfig`` keywords (speculation as ``speculative_config``)."""
    options = {k: v for k, v in setting.items() if k != "num_speculative_tokens"}
    k = setting.get("num_speculative_tokens", 0)
    options["speculative_config"] = {"method": "ngram", "num_speculative_tokens": k} if k else None
    return options


class Tuner:
    """Measures settings (``measure``) and walks the knobs (``sweep``) until the deadline."""

    def __init__(self, base: dict[str, Any], requests: list, slo, deadline: float, progress=None) -> None:
        self.base, self.requests, self.slo = base, requests, slo  # slo: tune_replay.Slo
        self.deadline, self.progress = deadline, progress
        self.rates: list[float] = []
        self.trials: list[Trial] = []
        self.skipped: list[dict[str, Any]] = []

    def out_of_time(self) -> bool:
        return time.monotonic() >= self.deadline

    def measure(self, setting: dict[str, Any], floor: int = 0, beat: Trial | None = None) -> Trial:
        """Build the setting's engine and search its goodput on the ladder's rungs from ``floor`` up. A goodput
        over ``beat``'s (the best so far) is checked on another arrival pattern, paired (``confirm``)."""
        from engine import LLMEngine
        from kvserve.bench.tune_replay import replay

        trial = Trial(dict(setting))
        engine = LLMEngine(**self.base, **engine_options(setting))
        try:
            replay(engine, self.requests[:4], math.inf)  # warm-up
            if not self.rates:  # the ladder, from the first (default) setting's capacity
                capacity = replay(engine, self.requests, math.inf).request_throughput
                self.rates = [round(capacity * f, 4) for f in RATE_FRACTIONS]
            start = min(floor + 1, len(self.rates) - 1) if beat and beat.goodput else RATE_FRACTIONS.index(1.0)
            self.search([(engine, trial)], floor, start, SWEEP_SEED)
            if beat is not None and trial.goodput > beat.goodput:
                self.confirm(engine, trial, beat)
        finally:
            engine.close()
        self.trials.append(trial)
        if self.progress is not None:
            self.progress.set_postfix_str(f"{_shown(setting)}: {trial.goodput:g} req/s")
            self.progress.update(1)
        return trial

    def confirm(self, engine, trial: Trial, best: Trial) -> None:
        """Replay ``trial``'s setting (on ``engine``) and ``best``'s at ``trial``'s goodput on another arrival
        pattern: ``trial`` stands only if it stays further inside the SLO there than ``best`` by over
        ``TIE_MARGIN``. Paired, because a pattern can be harder for every setting: beating the best on the sweep's
        pattern by one lucky replay does not pass, and neither setting need meet the SLO on the other one."""
        from engine import LLMEngine
        from kvserve.bench.tune_replay import replay

        again = replay(engine, self.requests, trial.goodput, seed=CONFIRM_SEED)
        rival_engine = LLMEngine(**self.base, **engine_options(best.setting))
        try:
            rival = replay(rival_engine, self.requests, trial.goodput, seed=CONFIRM_SEED)
        finally:
            rival_engine.close()
        trial.points.append(again)
        trial.confirmed = headroom(again, self.slo) > headroom(rival, self.slo) + TIE_MARGIN

    def search(self, runs: list[tuple[Any, Trial]], floor: int, start: int, seed: int) -> None:
        """Bisection on the rungs ``floor..`` of the ladder, first probing ``start``, for each (engine, trial) of
        ``runs``: the highest rung that meets the SLO becomes the trial's goodput (0 when even ``floor`` misses).
        Every rung replays the arrival pattern of ``seed``, at its own rate. Several runs are searched in
        lockstep, each probing its next rung in turn, so that their replays lie minutes apart at most: this
        machine's speed drifts over minutes, and a side searched after the other would inherit the drift."""
        from kvserve.bench.tune_replay import replay

        bounds = {id(trial): [floor - 1, len(self.rates), start] for _, trial in runs}  # met, missed, next rung
        for _, trial in runs:
            trial.floor = self.rates[floor]
        while any(missed - met > 1 for met, missed, _ in bounds.values()):
            for engine, trial in runs:
                state = bounds[id(trial)]
                met, missed, rung = state
                if missed - met <= 1:
                    continue
                point = replay(engine, self.requests, self.rates[rung], seed=seed)
                trial.points.append(point)
                state[0 if point.meets(self.slo) else 1] = rung
                state[2] = (state[0] + state[1]) // 2
        for _, trial in runs:
            met = bounds[id(trial)][0]
            trial.goodput = self.rates[met] if met >= floor else 0.0

    def better(self, trial: Trial, than: Trial) -> bool:
        """More goodput, confirmed; at equal goodput, more headroom inside the SLO by over ``TIE_MARGIN``."""
        if not trial.confirmed:
            return False
        if trial.goodput != than.goodput:
            return trial.goodput > than.goodput
        return trial.goodput > 0 and trial.headroom(self.slo) > than.headroom(self.slo) + TIE_MARGIN

    def sweep(self, default: dict[str, Any]) -> dict[str, Any]:
        """The best setting coordinate descent finds from ``default`` before the deadline; what the deadline
        left unmeasured goes to ``skipped``."""
        best = self.measure(default)
        for knob, values in KNOBS:
            start = values.index(best.setting[knob]) if best.setting[knob] in values else 0
            for direction in (1, -1):
                i = start + direction
                while 0 <= i < len(values):
                    candidate = {**best.setting, knob: values[i]}
                    if self.out_of_time():
                        self.skipped.append(candidate)
                        i += direction
                        continue
                    trial = self.measure(candidate, floor=self.rung(best.goodput), beat=best)
                    if not self.better(trial, best):
                        break  # the values further this way are taken as dominated
                    best, i = trial, i + direction
        return best.setting

    def rung(self, goodput: float) -> int:
        """The rung a candidate's search starts at: the best goodput's (to tie it), the lowest without one."""
        return self.rates.index(goodput) if goodput in self.rates else 0


def _shown(setting: dict[str, Any], default: dict[str, Any] | None = None) -> str:
    return " ".join(f"{k}={v}" for k, v in setting.items() if default is None or default.get(k) != v) or "default"


def default_setting() -> dict[str, Any]:
    from engine.config import EngineConfig

    defaults = EngineConfig()
    setting = {knob: getattr(defaults, knob, None) for knob, _ in KNOBS if knob != "num_speculative_tokens"}
    return setting | {"num_speculative_tokens": 0}


def write_outputs(out: Path, tuner: Tuner, default: dict[str, Any], chosen: dict[str, Any],
                  cluster: dict[str, int] | None) -> None:  # fmt: skip
    from dataclasses import asdict

    from kvserve.bench.tune_output import write_config, write_plots, write_table

    out.mkdir(parents=True, exist_ok=True)
    rows = [t.row(tuner.slo) for t in tuner.trials]
    slo = tuner.slo
    (out / "tuning.json").write_text(json.dumps({"slo": asdict(slo), "default": default, "chosen": chosen,
                                                 "cluster": cluster, "trials": rows,
                                                 "not_measured": tuner.skipped}, indent=1, default=str))  # fmt: skip
    write_table(out / "tuning.md", rows, default, chosen, tuner.skipped, slo)
    write_plots(out, tuner.trials, default, slo)
    write_config(out / "kvserve.yaml", engine_options(chosen), cluster)


def slo_of(args: argparse.Namespace):
    """The SLO the flags ask for: ``--ttft-p99``/``--tpot-p99`` set a bound with 99% attainment, and cannot be
    given with ``--attainment``; ``ValueError`` naming the flag otherwise."""
    from kvserve.bench.tune_replay import Slo

    p99 = args.ttft_p99 is not None or args.tpot_p99 is not None
    if p99 and args.attainment is not None:
        raise ValueError("--ttft-p99/--tpot-p99 mean 99% attainment: give --attainment with --ttft-slo/--tpot-slo")
    ttft = args.ttft_p99 if args.ttft_p99 is not None else args.ttft_slo
    tpot = args.tpot_p99 if args.tpot_p99 is not None else args.tpot_slo
    return Slo(ttft, tpot, 0.99 if p99 else 0.9 if args.attainment is None else args.attainment)


def main(argv: list[str] | None = None) -> int:
    from kvserve.bench.tune_output import add_workload_args, compare, split_workers, workload

    parser = argparse.ArgumentParser(prog="kvserve tune", description=__doc__.split("\n")[0])
    add_workload_args(parser)
    parser.add_argument("--ttft-slo", type=float, default=2.0, help="a request's TTFT bound, seconds")
    parser.add_argument("--tpot-slo", type=float, default=0.25, help="a request's TPOT bound, seconds")
    parser.add_argument("--attainment", type=float, default=None,
                        help="the fraction of requests that must meet both bounds (default 0.9, DistServe's)")
    parser.add_argument("--ttft-p99", type=float, default=None, help="--ttft-slo S with 99%% attainment")
    parser.add_argument("--tpot-p99", type=float, default=None, help="--tpot-slo S with 99%% attainment")
    parser.add_argument("--budget", default="10m", help="time for the sweep: 90s, 10m, 1h")
    parser.add_argument("--workers", type=int, default=0, help="split this many workers into prefill:decode")
    parser.add_argument("--repeats", type=int, default=3, help="searches of each side in the closing side by side")
    parser.add_argument("--output-dir", default="tune-out")
    args = parser.parse_args(argv)
    try:
        budget_s = parse_budget(args.budget)
        slo = slo_of(args)
    except ValueError as err:
        parser.error(str(err))
    from tqdm import tqdm

    base, requests = workload(args)
    default = default_setting()
    print(f"kvserve tune: goodput at {slo.describe()}")
    started = time.monotonic()
    with tqdm(desc="kvserve tune", unit="setting") as progress:
        tuner = Tuner(base, requests, slo, started + budget_s, progress)
        chosen = tuner.sweep(default)
    cluster = split_workers(args, base, chosen, requests, tuner) if args.workers >= 2 else None
    write_outputs(Path(args.output_dir), tuner, default, chosen, cluster)
    print((Path(args.output_dir) / "tuning.md").read_text())
    compare(tuner, default, chosen, args.repeats)
    return 0
