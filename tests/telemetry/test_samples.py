"""SampleLogger: complete rows in samples.jsonl every N steps, k per step, rank 0 only, TensorBoard text, wandb table,
resume truncation."""

from __future__ import annotations

import json
import math

import pytest
import torch

from ds_rlhf.telemetry.samples import (
    ROW_KEYS,
    SAMPLES_FILE,
    SampleLogger,
    markdown_table,
    read_samples,
    truncate_samples,
)


def make_rows(step: int, count: int = 5) -> list[dict]:
    return [{"prompt": f"What is {step} + {i}?", "response": f"{step} + {i} = {step + i}. #### {step + i}",
             "reward": 1.0 if i % 2 == 0 else 0.0, "reward_components": {"gsm8k": float(i % 2 == 0), "format": 1.0},
             "ground_truth": str(step + i), "advantage": torch.tensor(0.5 - i / 10), "weights_version": step - 1,
             "data_source": "toy"} for i in range(count)]


def test_rows_complete_every_n_steps_k_per_step(tmp_path):
    logger = SampleLogger(tmp_path, rank=0, every=2, k=3)
    written = [logger.maybe_log(step, make_rows(step)) for step in range(1, 7)]
    logger.close()
    assert written == [0, 3, 0, 3, 0, 3]
    records = read_samples(tmp_path)
    assert [r["step"] for r in records] == [2, 2, 2, 4, 4, 4, 6, 6, 6]
    first = records[0]
    assert set(ROW_KEYS) | {"step", "data_source"} == set(first)
    assert first["prompt"] == "What is 2 + 0?" and first["response"].endswith("#### 2")
    assert first["reward_components"] == {"gsm8k": 1.0, "format": 1.0} and first["ground_truth"] == "2"
    assert first["advantage"] == pytest.approx(0.5) and first["weights_version"] == 1
    assert [r["prompt"] for r in records[3:6]] == [f"What is 4 + {i}?" for i in range(3)]


def test_fewer_rows_than_k_and_appending_after_a_restart(tmp_path):
    logger = SampleLogger(tmp_path, rank=0, every=1, k=10)
    assert logger.maybe_log(1, make_rows(1, count=2)) == 2 and logger.maybe_log(2, []) == 0
    logger.close()
    with open(tmp_path / SAMPLES_FILE, "a") as f:
        f.write('{"step": 3, "prom')  # a crash mid-write
    with pytest.warns(UserWarning, match="torn"):  # cut before appending, so the next record starts a line
        logger = SampleLogger(tmp_path, rank=0, every=1, k=1)
    logger.maybe_log(4, make_rows(4))
    logger.close()
    assert [r["step"] for r in read_samples(tmp_path)] == [1, 1, 4]


def test_other_ranks_and_every_zero_write_nothing(tmp_path):
    for rank, every, k in [(1, 1, 4), (3, 2, 4), (0, 0, 4), (0, 1, 0)]:
        out = tmp_path / f"r{rank}_{every}_{k}"
        logger = SampleLogger(out, rank=rank, every=every, k=k)
        assert not logger.due(2)
        assert logger.maybe_log(2, make_rows(2)) == 0
        logger.close()
        assert not out.exists()
    with pytest.raises(ValueError):
        SampleLogger(tmp_path, rank=0, every=-1, k=1)


def test_missing_keys_are_refused_and_non_finite_kept_visibly(tmp_path):
    logger = SampleLogger(tmp_path, rank=0, every=1, k=2)
    row = make_rows(1)[0]
    del row["advantage"]
    with pytest.raises(ValueError, match="advantage"):
        logger.maybe_log(1, [row])
    row = {**make_rows(1)[0], "reward": math.nan}
    logger.maybe_log(1, [row])
    logger.close()
    assert read_samples(tmp_path)[0]["reward"] == "nan"  # strict JSON: NaN as a string, as metrics.jsonl does


def test_tensorboard_gets_a_text_table(tmp_path):
    SummaryWriter = pytest.importorskip("torch.utils.tensorboard").SummaryWriter
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    writer = SummaryWriter(str(tmp_path / "tensorboard"))
    logger = SampleLogger(tmp_path, rank=0, every=1, k=2, tensorboard_writer=writer)
    rows = make_rows(3)
    rows[0]["response"] = "line one\nline | two"
    logger.maybe_log(3, rows)
    logger.close()
    writer.close()
    acc = event_accumulator.EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()
    tag = "samples/text_summary"
    assert tag in acc.Tags()["tensors"]
    (event,) = acc.Tensors(tag)
    text = event.tensor_proto.string_val[0].decode()
    assert event.step == 3
    assert "What is 3 + 0?" in text and "What is 3 + 1?" in text and "What is 3 + 2?" not in text
    assert "line one<br>line \\| two" in text and "gsm8k=1, format=1" in text


def test_markdown_table_shape():
    records = [{"step": 1, **{k: v for k, v in make_rows(1)[0].items() if k != "advantage"}, "advantage": 0.25}]
    lines = markdown_table(1, records, max_chars=5).splitlines()
    assert len(lines) == 3 and lines[0].count("|") == lines[2].count("|") == 10  # step, the 7 row keys and group
    assert "What ... (9 more chars)" in lines[2]


def test_wandb_run_gets_a_table(tmp_path):
    wandb = pytest.importorskip("wandb")

    class FakeRun:
        def __init__(self):
            self.logged = []

        def log(self, data, step=None):
            self.logged.append((step, data))

    run = FakeRun()
    logger = SampleLogger(tmp_path, rank=0, every=1, k=2, wandb_run=run)
    logger.maybe_log(5, make_rows(5))
    logger.close()
    ((step, data),) = run.logged
    table = data["samples"]
    assert step == 5 and isinstance(table, wandb.Table)
    assert table.columns[:3] == ["step", "prompt", "response"] and len(table.data) == 2
    assert table.data[0][1] == "What is 5 + 0?" and json.loads(table.data[0][4]) == {"gsm8k": 1.0, "format": 1.0}

    class BrokenRun:
        def log(self, data, step=None):
            raise RuntimeError("offline disk full")

    logger = SampleLogger(tmp_path / "b", rank=0, every=1, k=1, wandb_run=BrokenRun())
    assert logger.maybe_log(1, make_rows(1)) == 1  # a failing wandb never stops the run; JSONL still written
    logger.close()


def test_truncate_samples_on_resume(tmp_path):
    assert truncate_samples(tmp_path, 3) == 0
    logger = SampleLogger(tmp_path, rank=0, every=1, k=2)
    for step in range(1, 6):
        logger.maybe_log(step, make_rows(step))
    logger.close()
    assert truncate_samples(tmp_path, 3) == 4
    assert [r["step"] for r in read_samples(tmp_path)] == [1, 1, 2, 2, 3, 3]
    assert not list(tmp_path.glob(".samples.jsonl.tmp"))


def test_rows_with_a_prompt_index_get_their_group(tmp_path):
    logger = SampleLogger(tmp_path, rank=0, every=1, k=4)
    rows = [{**row, "prompt_index": i // 2, "sample_index": i % 2} for i, row in enumerate(make_rows(3, 4))]
    logger.maybe_log(3, rows)
    logger.maybe_log(4, make_rows(4, 1))  # rows without a prompt_index get no group
    logger.close()
    records = read_samples(tmp_path)
    assert [(r["prompt_index"], r["group"]) for r in records[:4]] == [(0, "3/0"), (0, "3/0"), (1, "3/1"), (1, "3/1")]
    assert "group" not in records[4]
