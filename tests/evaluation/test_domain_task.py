"""The K40 domain-continuation task writer and the task loss (gold choice's bits per byte). Pure."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from marin.evaluation.multiple_choice import (
    DomainTaskConfig,
    Question,
    TaskError,
    domain_task_questions,
    gold_bpb,
    read_task,
    write_domain_task,
)


def test_gold_bpb_is_the_correct_choices_nll_per_byte():
    qs = [Question("c", (" ab", " cdef"), 1), Question("c", (" x", " yy"), 0)]
    ll = [np.array([-1.0, -4.0]), np.array([-2.0, -9.0])]
    # 4 nats over 5 bytes, 2 nats over 2 bytes, in bits
    assert gold_bpb(qs, ll) == pytest.approx((4 / 5 + 2 / 2) / 2 / math.log(2))


def test_domain_task_is_deterministic_and_readable(tmp_path):
    cfg = DomainTaskConfig(output_path=str(tmp_path), domains=("council", "infra", "web_code", "science", "law"),
                           questions_per_domain=4, n_choices=4, seed=0)
    qs = domain_task_questions(cfg)
    assert qs == domain_task_questions(cfg) and len(qs) == 20
    assert {q["gold"] for q in qs} == {0, 1, 2, 3}  # the gold slot rotates
    assert all(len(q["choices"]) == 4 and len(set(q["choices"])) == 4 for q in qs)
    assert write_domain_task(cfg) == {"questions": 20}
    back = read_task(str(tmp_path / "task.jsonl"))
    assert [q.gold for q in back] == [q["gold"] for q in qs] and json.loads(
        (tmp_path / "task.jsonl").read_text().splitlines()[0])["context"] == qs[0]["context"]
    with pytest.raises(TaskError, match="needs at least that many domains"):
        domain_task_questions(DomainTaskConfig(output_path="", domains=("council", "infra"), n_choices=4))
