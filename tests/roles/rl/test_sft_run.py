"""An SFT run end to end on an embedded cluster, on two trainers sharding the model: a tiny
checkpoint learns a trivial mapping (``Say 7:`` -> ``7``) from JSONL rows, its held-out loss
falls, the run folder holds what it should, the exported ``model/`` loads in ``transformers``
with orchestr's logits, and an RL config can start from it."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

import orchestr as oc
from orchestr.roles import models
from orchestr.roles.rl import (
    Checkpoint,
    SFTStep,
    load_sft_config,
    plan_rl,
    rl_config_from_dict,
    run_sft,
)

transformers = pytest.importorskip("transformers")


@pytest.mark.timeout(180)
async def test_sft_learns_the_rows_and_exports_a_model_transformers_loads(
    ctx: oc.JobContext, tmp_path: pathlib.Path
) -> None:
    models.make_tiny("llama", tmp_path / "model", hidden=32, heads=2, seed=1)
    rows = [
        {"prompt": f"Say {i % 10}:", "response": str(i % 10), "answer": str(i % 10)}
        for i in range(64)
    ]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "sft.toml").write_text(
        '[model]\npath = "model"\n'
        '[data]\npath = "rows.jsonl"\nheld_out_fraction = 0.125\nchat = true\n'
        "[schedule]\nsteps = 30\nbatch_size = 8\nlr = 1e-2\nwarmup_steps = 3\n"
        'lr_schedule = "cosine"\neval_every = 10\n'
        # two trainers sharding the model (FSDP2): the export gathers it whole
        '[trainer]\nmicro_batch_tokens = 64\nsharding = "full"\n'
        "[layout]\ntrainers = 2\n"
        "[run]\nexport_every = 15\n"
    )
    config = load_sft_config(str(tmp_path / "sft.toml"))
    seen: list[SFTStep] = []
    run = tmp_path / "run"
    plan, result, summary = await run_sft(ctx, config, seen.append, run_dir=str(run))
    assert len(plan.held_out) == 8 and len(plan.train) == 56
    assert [r.step for r in seen] == list(range(30)) and seen[-1].version == 30
    assert [r.held_out is not None for r in seen].count(True) == 3  # after 10, 20, 30

    # the held-out loss fell clearly: from about ln(vocabulary) a token to the digit's
    # uncertainty alone (about ln 10 over two tokens), the end token nearly certain
    first, last = summary["first_held_out"], summary["last_held_out"]
    assert last < 0.3 * first, (first, last)
    assert [e[1] for e in result.evals] == sorted((e[1] for e in result.evals), reverse=True)
    assert summary["tokens"] == sum(r.tokens for r in seen) and summary["tokens_per_s"] > 0
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if r["kind"] == "step"] == list(range(30))
    assert [r["version"] for r in lines if r["kind"] == "eval"] == [0, 10, 20, 30]
    assert {p.name for p in run.iterdir()} >= {
        "config.json",
        "metrics.jsonl",
        "summary.json",
        "model",
        "model-00015",
        "events.jsonl",
    }
    assert json.loads((run / "config.json").read_text())["schedule"]["steps"] == 30
    assert result.exported == str(run / "model")

    ours = models.load_model(run / "model").eval()
    # no progress bar: its tqdm monitor thread would outlive the test (the leak check's)
    transformers.utils.logging.disable_progress_bar()
    try:
        theirs = transformers.AutoModelForCausalLM.from_pretrained(run / "model").eval()
    finally:
        transformers.utils.logging.enable_progress_bar()
    tok = models.Tokenizer(run / "model")
    ids = torch.tensor([plan.held_out.prompts[0] + plan.held_out.responses[0]])
    with torch.no_grad():
        a, b = ours(ids), theirs(ids).logits
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    # the fine-tuned model answers a held-out prompt greedily with a digit, and stops
    prompt = plan.held_out.prompts[0]
    with torch.no_grad():
        out = theirs.generate(
            torch.tensor([prompt]),
            max_new_tokens=4,
            do_sample=False,
            eos_token_id=tok.eos_id,
            pad_token_id=tok.eos_id,
        )
    answer = out[0, len(prompt) :].tolist()
    assert len(answer) == 2 and answer[1] == tok.eos_id, answer
    assert tok.decode(answer[:1]).strip() in set("0123456789")

    # RL starts from it: an RL config naming model/ plans (the same rows, a reward on them)
    rl = rl_config_from_dict(
        {
            "model": {"path": str(run / "model")},
            "data": {"path": str(tmp_path / "rows.jsonl"), "chat": True},
            "reward": [{"function": "orchestr.roles.reward:exact_match"}],
        }
    )
    model = plan_rl(rl, str(tmp_path / "rl")).job.train.model
    assert isinstance(model, Checkpoint) and model.path == str(run / "model")
