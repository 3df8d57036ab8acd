"""orchestr's GRPO (``orchestr rl train``, sync and stream modes) side by side with TRL's
``GRPOTrainer``: the same tiny checkpoint, rows, reward and hyper-parameters, in one run.

    python bench/rl_recipe.py [--rounds 3] [--steps 20] [--prompts 32] [--group 8]
                              [--max-new 16] [--lr 2e-3] [--trl-threads 1]
                              [--systems sync,stream,trl] [--keep DIR]

What it runs, each round ``r`` (seed ``r``) in this order, each a fresh process:
``orchestr_sync`` and ``orchestr_stream`` (``python -m orchestr.cli rl train CONFIG --run-dir
DIR --quiet``, the run folder's ``metrics.jsonl`` read back) and ``trl`` (this file run again
in TRL's venv with ``--trl-worker``, writing a JSON line per batch). The rounds alternate
systems so that the machine's drift reaches all three alike.

- The checkpoint: a tiny Llama (``orchestr.roles.models.make_tiny("llama", ...)``: hidden 64,
  2 layers, a byte-level BPE of 391 tokens, a ChatML template), made once per run;
  ``transformers`` loads the folder as it is (``AutoModelForCausalLM``, ``AutoTokenizer``).
- The rows: ``reverse 3 1 4 ->`` with ``answer`` ``4 1 3`` (1-3 digits), 256 to train on
  and 8 held out (orchestr scores those at the start and the end; TRL has no evaluation).
- The reward: ``bench/_rl_recipe_reward.py:digit_answer`` (partial credit for the digits of
  the completion; a random policy scores about 0.1), called per sample by orchestr's reward
  workers and through a list wrapper by TRL.
- The hyper-parameters: :func:`orchestr_config` and :func:`trl_config` write each system's
  explicitly; ``docs/bench/rl_recipe.md`` lists what still differs. Every process runs one
  torch thread: orchestr's roles (``layout.torch_threads = 1``) and TRL's (``--trl-threads``,
  ``OMP_NUM_THREADS``; torch's default of one per core collapsed it on a shared machine).

What it reports, per system, the median over rounds with min and max: ``samples_per_s``
(trained samples over the batches after the first, from the end of the first batch to the end
of the last: start-up and warm-up left out for both), ``step_s_p50`` (the median time between
the ends of two batches), ``reward_first`` and ``reward_last`` (the mean batch reward of the
first and of the last ``--window`` batches), ``peak_rss_mib`` (the peak, over samples of
``/proc`` every 0.2 s, of the summed RSS of the system's process tree: the process started,
its descendants and its session; pages shared between processes, torch's libraries among
them, count once per process; ``peak_pss_mib`` splits them) and ``start_s`` (from the process's start to the end of its
first batch). The seed-to-seed spread of ``reward_last`` is max - min over rounds. The last
line is the JSON ``{"orchestr_sync": {...}, "orchestr_stream": {...}, "trl": {...}}``.

TRL's venv: ``bench/.venvs/trl``, made on first use (by ``bench/_venvs.py``'s
``ensure_venv``) when missing: ``python3 -m venv bench/.venvs/trl``, then ``pip install
torch==2.13.0`` (the local CPU build, first, so nothing pulls CUDA wheels), then the pins of
:data:`TRL_REQUIREMENTS` one by one. Nothing is downloaded but those packages.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import pathlib
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

BENCH = pathlib.Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))

from _procs import Processes, exit_on_signal  # noqa: E402

#: TRL and what it runs on, pinned to what installed beside torch 2.13.0 without moving it.
TRL_PRE: list[str] = ["torch==2.13.0"]
TRL_REQUIREMENTS: list[str] = [
    "transformers==5.25.0",
    "accelerate==1.16.0",
    "datasets==5.2.0",
    "trl==1.16.0",
]
SYSTEMS = {"sync": "orchestr_sync", "stream": "orchestr_stream", "trl": "trl"}
REWARD = "_rl_recipe_reward:digit_answer"


# -- the task ----------------------------------------------------------------------------
def write_rows(folder: pathlib.Path, train: int = 256, held: int = 8) -> tuple[str, str]:
    """``train.jsonl`` and ``held.jsonl``: ``reverse d1 .. dn ->`` prompts, 1-3 digits, each
    with its ``answer`` (the digits reversed), drawn from a fixed seed."""
    rng = random.Random(1234)
    rows = []
    for _ in range(train + held):
        digits = [str(rng.randrange(10)) for _ in range(rng.randint(1, 3))]
        prompt = "reverse " + " ".join(digits) + " ->"
        rows.append({"prompt": prompt, "answer": " ".join(reversed(digits))})
    paths = []
    for name, part in (("train.jsonl", rows[:train]), ("held.jsonl", rows[train:])):
        path = folder / name
        path.write_text("".join(json.dumps(r) + "\n" for r in part))
        paths.append(str(path))
    return paths[0], paths[1]


def make_checkpoint(folder: pathlib.Path) -> str:
    from orchestr.roles.models import make_tiny

    return make_tiny("llama", folder, seed=0)


# -- each system's configuration ---------------------------------------------------------
def orchestr_config(args: argparse.Namespace, mode: str, seed: int, data: dict[str, str]) -> str:
    """The ``orchestr rl train`` TOML of one run: every key that matters to the comparison
    written out, the rest at ``orchestr rl train --help``'s defaults."""
    return f"""\
[model]
path = "{data["model"]}"

[data]
path = "{data["train"]}"
held_out = "{data["held"]}"     # 8 rows, greedy, scored at the start and the end

[[reward]]
function = "{REWARD}"

[algorithm]
name = "grpo"                 # (r - group mean) / (group std + 1e-4)
updates_per_step = {args.updates}           # optimizer steps per batch (TRL num_iterations)
clip_eps = 0.2
loss_agg = "token_mean"       # TRL loss_type = "dapo"
kl_coef = 0.0                 # TRL beta = 0.0
entropy_coef = {args.entropy}
temperature = 1.0
max_new_tokens = {args.max_new}
max_grad_norm = 1.0
behaviour_weight_cap = 2.0    # decoupled ratio: TRL has no separate behaviour policy

[schedule]
steps = {args.steps}
prompts_per_step = {args.prompts}
group_size = {args.group}
lr = {args.lr}
lr_schedule = "constant"
warmup_steps = 0
betas = [0.9, 0.999]
weight_decay = 0.0
eval_every = {args.steps}
seed = {seed}

[trainer]
dtype = "float32"

[layout]
mode = "{mode}"
generators = 2
trainers = 1
rewards = 1
torch_threads = 1
eta = 1
lookahead = 1

[run]
checkpoint_every = 0          # TRL saves nothing either
export = false
"""


def trl_config(args: argparse.Namespace, seed: int, out: str) -> dict[str, Any]:
    """``GRPOConfig``'s keyword arguments for one run. A batch is ``prompts x group``
    completions, generated once and trained on ``num_iterations`` times, each time in one
    optimizer step over the whole batch (one micro-batch, no accumulation): orchestr's
    ``updates_per_step`` full-batch steps. ``max_steps`` counts optimizer steps."""
    return {
        "output_dir": out,
        "per_device_train_batch_size": args.prompts * args.group,
        "gradient_accumulation_steps": 1,
        "num_generations": args.group,
        "num_iterations": args.updates,
        "max_steps": args.steps * args.updates,
        "max_completion_length": args.max_new,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "beta": 0.0,
        "epsilon": 0.2,
        "loss_type": "dapo",
        "scale_rewards": "group",
        "entropy_coef": args.entropy,
        "mask_truncated_completions": False,
        "learning_rate": args.lr,
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        "optim": "adamw_torch",
        "adam_beta1": 0.9,
        "adam_beta2": 0.999,
        "adam_epsilon": 1e-8,
        "weight_decay": 0.0,
        "max_grad_norm": 1.0,
        "seed": seed,
        "data_seed": seed,
        "use_cpu": True,
        "bf16": False,
        "fp16": False,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
        "log_completions": False,
    }


# -- the TRL side (runs in TRL's venv) ---------------------------------------------------
def trl_worker(spec_path: str) -> int:
    """Train with TRL's ``GRPOTrainer`` as ``spec_path`` (JSON) says, writing a JSON line per
    batch (its mean reward, the time its last optimizer step ended) to ``spec["out"]``."""
    spec = json.loads(pathlib.Path(spec_path).read_text())
    started = time.perf_counter()
    import datasets
    import torch
    import transformers
    import trl
    from _rl_recipe_reward import digit_answer
    from transformers import TrainerCallback

    out = open(spec["out"], "w", encoding="utf-8")
    rows = [json.loads(line) for line in open(spec["train"], encoding="utf-8") if line.strip()]
    rewards: list[float] = []

    def reward(
        prompts: list[str], completions: list[str], answer: list[str], **_: Any
    ) -> list[float]:
        values = [
            digit_answer(p, c, a) for p, c, a in zip(prompts, completions, answer, strict=True)
        ]
        rewards.append(sum(values) / len(values))
        return values

    reward.__name__ = "digit_answer"
    per_batch = spec["config"]["num_iterations"]

    class Batches(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step % per_batch == 0:
                row = {
                    "step": state.global_step // per_batch - 1,
                    "reward": rewards[-1],
                    "t": time.perf_counter() - started,
                }
                out.write(json.dumps(row) + "\n")
                out.flush()

    tokenizer = transformers.AutoTokenizer.from_pretrained(spec["model"])
    model = transformers.AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    trainer = trl.GRPOTrainer(
        model=model,
        processing_class=tokenizer,
        reward_funcs=[reward],
        args=trl.GRPOConfig(**spec["config"]),
        train_dataset=datasets.Dataset.from_list(rows),
        callbacks=[Batches()],
    )
    trainer.train()
    versions = {"trl": trl.__version__, "transformers": transformers.__version__}
    versions |= {"torch": torch.__version__, "torch_threads": torch.get_num_threads()}
    out.write(json.dumps({"versions": versions}) + "\n")
    out.close()
    return 0


# -- running a system and watching its memory --------------------------------------------
def _tree(root: int) -> set[int]:
    """``root``, its descendants and the members of its session (``root`` leads one)."""
    parents: dict[int, int] = {}
    found = {root}
    for entry in os.listdir("/proc"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            with open(f"/proc/{entry}/stat") as f:  # after the name: state ppid pgrp session
                fields = f.read().rpartition(")")[2].split()
            parents[int(entry)] = int(fields[1])
            if int(fields[3]) == root:
                found.add(int(entry))
    frontier = [root]
    while frontier:
        pid = frontier.pop()
        for child, parent in parents.items():
            if parent == pid and child not in found:
                found.add(child)
                frontier.append(child)
    return found


def _memory_kib(pid: int) -> tuple[int, int]:
    """(RSS, PSS) of ``pid`` in KiB; zeros for a process gone."""
    rss = pss = 0
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Rss:"):
                    rss = int(line.split()[1])
                elif line.startswith("Pss:"):
                    pss = int(line.split()[1])
    return rss, pss


class PeakRSS:
    """Samples the summed RSS (and PSS, which splits shared pages among the processes sharing
    them) of a process tree every ``every`` seconds on a thread."""

    def __init__(self, root: int, every: float = 0.2) -> None:
        self.root, self.every = root, every
        self.peak_rss_kib = self.peak_pss_kib = 0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.is_set():
            sizes = [_memory_kib(pid) for pid in _tree(self.root)]
            self.peak_rss_kib = max(self.peak_rss_kib, sum(r for r, _ in sizes))
            self.peak_pss_kib = max(self.peak_pss_kib, sum(p for _, p in sizes))
            self.done.wait(self.every)

    def stop(self) -> tuple[float, float]:
        """Stop sampling; return the peaks (RSS, PSS) in MiB."""
        self.done.set()
        self.thread.join()
        return self.peak_rss_kib / 1024, self.peak_pss_kib / 1024


def run_tree(
    procs: Processes, cmd: list[str], env: dict[str, str], log: pathlib.Path, timeout: float,
    first: pathlib.Path,
) -> tuple[float, float, tuple[float, float]]:  # fmt: skip
    """Run ``cmd`` (its own session) to the end; return (seconds, seconds until the file
    ``first`` had its first line (the first batch's), the tree's peak (RSS, PSS) in MiB). Raises
    RuntimeError with the tail of its output when it fails or runs past ``timeout``."""
    first_s = float("nan")
    with open(log, "w") as out:
        start = time.perf_counter()
        proc = procs.start(cmd, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        rss = PeakRSS(proc.pid)
        try:
            while proc.poll() is None and time.perf_counter() - start < timeout:
                if first_s != first_s and first.exists() and first.stat().st_size:  # nan
                    first_s = time.perf_counter() - start  # its first line: the first batch
                time.sleep(0.1)
        finally:
            peak = rss.stop()
            seconds = time.perf_counter() - start
            code = proc.poll()
            procs.stop(proc)  # whatever it left behind in its session
    if code != 0:
        tail = "\n".join(log.read_text().splitlines()[-30:])
        what = f"ran past {timeout:.0f} s" if code is None else f"exited {code}"
        raise RuntimeError(f"{' '.join(cmd[:6])} ... {what}:\n{tail}")
    return seconds, first_s, peak


def figures(times: list[float], rewards: list[float], batch: int, window: int) -> dict[str, Any]:
    """A run's figures from the end time and mean reward of each batch."""
    gaps = [b - a for a, b in itertools.pairwise(times)]
    return {
        "samples_per_s": (len(times) - 1) * batch / (times[-1] - times[0]),
        "step_s_p50": statistics.median(gaps),
        "reward_first": statistics.fmean(rewards[:window]),
        "reward_last": statistics.fmean(rewards[-window:]),
        "rewards": rewards,
    }


def run_orchestr(
    procs: Processes, args: argparse.Namespace, mode: str, seed: int, data: dict[str, str],
    work: pathlib.Path,
) -> dict[str, Any]:  # fmt: skip
    folder = work / f"orchestr-{mode}-{seed}"
    folder.mkdir()
    config = folder / "run.toml"
    config.write_text(orchestr_config(args, mode, seed, data))
    run_dir = folder / "run"
    cmd = [sys.executable, "-m", "orchestr.cli", "rl", "train", str(config)]
    cmd += ["--run-dir", str(run_dir), "--quiet"]
    # the reward workers import _rl_recipe_reward from bench/
    path = os.pathsep.join(p for p in (str(BENCH), str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PYTHONPATH=path)
    seconds, first_s, peak = run_tree(
        procs, cmd, env, folder / "log.txt", args.timeout, run_dir / "metrics.jsonl"
    )
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = sorted((r for r in rows if r["kind"] == "step"), key=lambda r: r["step"])
    # a step's wall_s counts from the job's start, after its roles were spawned
    times = [r["wall_s"] for r in steps]
    out = figures(times, [r["reward"] for r in steps], args.prompts * args.group, args.window)
    out["start_s"] = first_s
    out |= {"peak_rss_mib": peak[0], "peak_pss_mib": peak[1], "process_s": seconds}
    return out


def run_trl(
    procs: Processes, python: pathlib.Path, args: argparse.Namespace, seed: int,
    data: dict[str, str], work: pathlib.Path,
) -> dict[str, Any]:  # fmt: skip
    folder = work / f"trl-{seed}"
    folder.mkdir()
    spec = {
        "model": data["model"],
        "train": data["train"],
        "out": str(folder / "batches.jsonl"),
        "config": trl_config(args, seed, str(folder / "trainer")),
    }
    (folder / "spec.json").write_text(json.dumps(spec, indent=2))
    cmd = [str(python), str(pathlib.Path(__file__).resolve()), "--trl-worker"]
    cmd.append(str(folder / "spec.json"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env |= {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env |= {"TOKENIZERS_PARALLELISM": "false", "WANDB_DISABLED": "true"}
    if args.trl_threads:
        env["OMP_NUM_THREADS"] = str(args.trl_threads)
    seconds, first_s, peak = run_tree(
        procs, cmd, env, folder / "log.txt", args.timeout, pathlib.Path(spec["out"])
    )
    lines = [json.loads(line) for line in pathlib.Path(spec["out"]).read_text().splitlines()]
    steps = [r for r in lines if "step" in r]
    out = figures(
        [r["t"] for r in steps], [r["reward"] for r in steps], args.prompts * args.group,
        args.window,
    )  # fmt: skip
    out |= {"peak_rss_mib": peak[0], "peak_pss_mib": peak[1], "process_s": seconds}
    out["start_s"] = first_s
    out["versions"] = next((r["versions"] for r in lines if "versions" in r), {})
    return out


# -- the report --------------------------------------------------------------------------
KEYS = (
    "samples_per_s", "step_s_p50", "reward_first", "reward_last", "peak_rss_mib", "peak_pss_mib",
    "start_s",
)  # fmt: skip


def machine() -> str:
    import torch

    import orchestr

    load = os.getloadavg()
    return (
        f"{platform.node()} | {os.cpu_count()} cores | load {load[0]:.2f} {load[1]:.2f} "
        f"{load[2]:.2f} | Python {platform.python_version()} | torch {torch.__version__} | "
        f"orchestr {getattr(orchestr, '__version__', '?')}"
    )


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in KEYS:
        values = [r[key] for r in runs]
        out[key] = round(statistics.median(values), 4)
        out[f"{key}_min"] = round(min(values), 4)
        out[f"{key}_max"] = round(max(values), 4)
    out["reward_last_spread"] = round(out["reward_last_max"] - out["reward_last_min"], 4)
    out["rounds"] = len(runs)
    return out


def report(results: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> dict[str, Any]:
    summary = {name: summarise(runs) for name, runs in results.items() if runs}
    print()
    print(
        f"{'system':16} {'samples/s':>22} {'step s p50':>10} {'reward first':>13} "
        f"{'reward last':>22} {'RSS MiB':>8} {'PSS MiB':>8} {'start s':>8}"
    )
    for name, s in summary.items():
        print(
            f"{name:16} {s['samples_per_s']:8.1f} [{s['samples_per_s_min']:5.1f}-"
            f"{s['samples_per_s_max']:5.1f}] {s['step_s_p50']:10.3f} {s['reward_first']:13.3f} "
            f"{s['reward_last']:8.3f} [{s['reward_last_min']:.3f}-{s['reward_last_max']:.3f}] "
            f"{s['peak_rss_mib']:8.0f} {s['peak_pss_mib']:8.0f} {s['start_s']:8.1f}"
        )
    print(f"(medians over {args.rounds} round(s), [min-max]; reward = mean batch reward of the "
          f"first/last {args.window} batches)")  # fmt: skip
    # the curves, averaged over rounds, at a few batches
    names = list(summary)
    marks = sorted({0, *range(4, args.steps, 5), args.steps - 1})
    print("\nmean batch reward over rounds, by batch:")
    print("batch " + "".join(f"{n:>17}" for n in names))
    for step in marks:
        cells = []
        for n in names:
            values = [r["rewards"][step] for r in results[n] if step < len(r["rewards"])]
            cells.append(f"{statistics.fmean(values):17.3f}" if values else f"{'-':>17}")
        print(f"{step:5d} " + "".join(cells))
    if "trl" in summary:
        trl = summary["trl"]
        for name in names:
            if name == "trl":
                continue
            s = summary[name]
            ratio = s["samples_per_s"] / trl["samples_per_s"]
            gap = abs(s["reward_last"] - trl["reward_last"])
            spread = max(s["reward_last_spread"], trl["reward_last_spread"])
            print(
                f"{name} / trl: {ratio:.2f}x samples/s (aim >= 2x: "
                f"{'met' if ratio >= 2 else 'missed'}); reward_last differs by {gap:.3f}, "
                f"seed-to-seed spread {spread:.3f}: "
                f"{'within' if gap <= spread else 'outside'} it"
            )
    return summary


# -- main --------------------------------------------------------------------------------
def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--trl-worker":
        return trl_worker(sys.argv[2])
    from _record import add_record_flag, record

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds; round r uses seed r")
    parser.add_argument("--steps", type=int, default=20, help="batches per run")
    parser.add_argument("--prompts", type=int, default=32, help="prompts per batch")
    parser.add_argument("--group", type=int, default=8, help="samples per prompt")
    parser.add_argument("--max-new", type=int, default=16, help="completion tokens at most")
    parser.add_argument("--updates", type=int, default=4, help="optimizer steps per batch")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--entropy", type=float, default=0.0, help="entropy bonus coefficient")
    parser.add_argument("--window", type=int, default=3, help="batches in reward_first/last")
    parser.add_argument("--systems", default="sync,stream,trl")
    # one thread, as each of orchestr's roles has (layout.torch_threads = 1): on this 2-core
    # machine, shared, torch's default of 2 made TRL 18x slower (5.6 against 99.6 samples/s)
    parser.add_argument(
        "--trl-threads", type=int, default=1, help="TRL's torch threads (0: torch's default)"
    )
    parser.add_argument("--timeout", type=float, default=600, help="seconds per run at most")
    parser.add_argument("--keep", help="a folder to keep the runs in (default: a temporary one)")
    add_record_flag(parser)
    args = parser.parse_args()
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown or not systems:
        parser.error(f"--systems takes {', '.join(SYSTEMS)}; got {args.systems!r}")
    if args.steps < 2 or args.window > args.steps:
        parser.error("--steps must be at least 2 and at least --window")

    python = None
    if "trl" in systems:
        from _venvs import ensure_venv

        python = ensure_venv("trl", TRL_REQUIREMENTS, pre=TRL_PRE)
    print(machine(), flush=True)
    print(
        f"task: reverse 1-3 digits, reward {REWARD}; {args.steps} batches of {args.prompts} "
        f"prompts x {args.group} samples, <= {args.max_new} new tokens, lr {args.lr}, "
        f"{args.updates} updates/batch, entropy {args.entropy}; {args.rounds} round(s)",
        flush=True,
    )
    work = pathlib.Path(args.keep) if args.keep else pathlib.Path(tempfile.mkdtemp(prefix="rlr-"))
    work.mkdir(parents=True, exist_ok=True)
    procs = Processes()
    results: dict[str, list[dict[str, Any]]] = {SYSTEMS[s]: [] for s in systems}
    try:
        data = {"model": make_checkpoint(work / "model")}
        data["train"], data["held"] = write_rows(work)
        for seed in range(args.rounds):
            for system in systems:
                name = SYSTEMS[system]
                if system == "trl":
                    assert python is not None
                    run = run_trl(procs, python, args, seed, data, work)
                else:
                    run = run_orchestr(procs, args, system, seed, data, work)
                results[name].append(run)
                print(
                    f"round {seed} {name:16} {run['samples_per_s']:7.1f} samples/s, step "
                    f"{run['step_s_p50']:.3f} s, reward {run['reward_first']:.3f} -> "
                    f"{run['reward_last']:.3f}, peak RSS {run['peak_rss_mib']:.0f} MiB "
                    f"(PSS {run['peak_pss_mib']:.0f}), "
                    f"start {run['start_s']:.1f} s, process {run['process_s']:.1f} s",
                    flush=True,
                )
        versions = next((r["versions"] for r in results.get("trl", []) if r["versions"]), {})
        if versions:
            print(f"TRL side: {json.dumps(versions)}")
        summary = report(results, args)
    finally:
        procs.stop_all()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    keep = ("samples_per_s", "step_s_p50", "reward_first", "reward_last", "peak_rss_mib")
    line = {
        name: {k: s[k] for k in keep} | {"reward_last_spread": s["reward_last_spread"]}
        for name, s in summary.items()
    }
    print(json.dumps(line))
    if args.record:  # every round's value of each figure
        each = {n: {k: [r[k] for r in runs] for k in KEYS} for n, runs in results.items() if runs}
        for name, s in summary.items():
            each[name]["reward_last_spread"] = s["reward_last_spread"]
        peers = ["trl", "transformers", "accelerate", "datasets"] if "trl" in systems else []
        record("rl_recipe", each, peers=peers)
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, exit_on_signal)  # clean-ups run: the runs' processes end
    raise SystemExit(main())
