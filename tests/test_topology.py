"""The topology tells the truth: every topic a role reads is declared (``consumes`` or
``reads``), every declared fold reads only declared topics, and topology.py's read-back
section names each role's ``reads``; the runner refuses a fold that reads anything else."""

from __future__ import annotations

import asyncio

import pytest

from gyre_async.bus import open_bus
from gyre_async.experience.retention import CONSUMPTION_TOPICS
from gyre_async.folds.fold import FoldBase
from gyre_async.runtime import topology
from gyre_async.runtime.actor import Actor, ActorRunner
from gyre_async.runtime.topology import RUN_ROLES, actor_class, build_actor, inputs


def test_every_fold_of_every_role_reads_declared_topics_only(tiny, tmp_path):
    cfg = tiny.config()

    async def folds_of_each_role():
        async with open_bus(f"sqlite:///{tmp_path}/events.db") as bus:
            found = {}
            for role in RUN_ROLES:
                actor = build_actor(role, cfg)
                ActorRunner(actor, bus, run_id=cfg.run.run_id, name=role)
                found[role] = [set(f.topics) for f in actor.folds()]
            return found

    found = asyncio.run(folds_of_each_role())
    # the four roles that hold state rebuild it through folds; the evaluator holds none
    assert all(found[role] for role in ("sampler", "segmenter", "arbiter", "learner", "keeper"))
    for role, folds in found.items():
        cls = actor_class(role)
        declared = set(cls.consumes) | set(cls.emits) | set(cls.reads)
        for topics in folds:
            assert topics <= declared, (role, topics - declared)
        # what is read back but neither consumed nor emitted is in ``reads``
        read_back = set().union(*folds) - set(cls.consumes)
        assert read_back <= set(cls.reads) | set(cls.emits), role


def test_the_segmenters_retention_input_is_declared_and_in_the_topology():
    assert set(CONSUMPTION_TOPICS) <= set(inputs("segmenter")["reads"])
    doc = topology.__doc__ or ""
    section = doc[doc.index("Read back outside the consumer groups"):]
    for role in RUN_ROLES:
        for topic in inputs(role)["reads"]:
            line = next((ln for ln in section.splitlines() if ln.startswith(f"- {role}:")), "")
            block = section[section.index(line):] if line else ""
            assert line and topic in block.split("\n- ")[0], (role, topic)


class _Reader(Actor):
    role = "reader"
    consumes = ("eval",)

    def folds(self):
        fold = FoldBase()
        fold.topics = ("scored",)  # not declared by this role
        return (fold,)


def test_the_runner_refuses_a_fold_that_reads_an_undeclared_topic(tmp_path):
    async def start():
        async with open_bus(f"sqlite:///{tmp_path}/events.db") as bus:
            await ActorRunner(_Reader(), bus, run_id="r").start()

    with pytest.raises(TypeError, match=r"_Reader folds read \['scored'\].*`reads`"):
        asyncio.run(start())
