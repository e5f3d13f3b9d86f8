"""SFT and reward-model training on the addition task: learning happens, masks hold, exports chain together."""

from __future__ import annotations

import torch

from ds_rlhf.telemetry.logger import read_metrics


def test_sft_loss_falls_and_eval_improves(sft_run):
    out, summary = sft_run
    losses = [r["train/loss"] for r in read_metrics(out) if "train/loss" in r]
    assert len(losses) == 120
    assert sum(losses[-10:]) / 10 < 0.5 * sum(losses[:10]) / 10
    assert summary["eval_after"]["eval/loss"] < summary["eval_before"]["eval/loss"] - 1.0
    assert (out / "export" / "config.json").exists() and (out / "config.json").exists()


def test_masked_tokens_carry_no_loss(tiny_model_path, addition_stores):
    """Perturbing a token outside the loss mask leaves the loss unchanged; perturbing a trained token changes it."""
    from transformers import AutoModelForCausalLM

    from ds_rlhf.data.store import open_store
    from ds_rlhf.recipes.sft import masked_nll_sum

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    store = open_store(addition_stores["sft"])
    rows = [store.row(i) for i in range(4)]
    base, n = masked_nll_sum(model, rows, "cpu")
    assert n == sum(sum(r["loss_mask"][1:]) for r in rows)

    def perturbed(row_index, position):
        new = [dict(r) for r in rows]
        ids = list(new[row_index]["input_ids"])
        ids[position] = (ids[position] + 17) % 300
        new[row_index]["input_ids"] = ids
        return masked_nll_sum(model, new, "cpu")[0]

    mask = list(rows[1]["loss_mask"])
    assert mask[-1] == 0  # the newline after <|im_end|> is not trained, and nothing in its row comes after it
    assert torch.equal(perturbed(1, len(mask) - 1), base)
    trained = max(i for i, m in enumerate(mask) if m)
    assert not torch.allclose(perturbed(1, trained), base)


def test_reward_model_learns_the_preference_rule(rm_run):
    out, summary = rm_run
    assert summary["eval_before"]["eval/accuracy"] < 0.65
    assert summary["eval_after"]["eval/accuracy"] > 0.7
    assert (out / "export" / "config.json").exists()


def test_rm_export_loads_as_reward_and_critic(rm_run):
    from ds_rlhf.engines.models import CriticModel, RewardModel

    export = rm_run[0] / "export"
    ids = torch.tensor([[1, 5, 6, 7], [1, 8, 9, 0]])
    attn = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    scores = RewardModel.from_pretrained(export)(ids, attn)
    values = CriticModel.from_pretrained(export, init_from="reward")(ids, attn)
    assert scores.shape == (2,) and values.shape == (2, 4)
    # the critic's value at the last real token is the reward model's score (same weights, same head)
    assert torch.allclose(values[0, 3], scores[0], atol=1e-5) and torch.allclose(values[1, 2], scores[1], atol=1e-5)
