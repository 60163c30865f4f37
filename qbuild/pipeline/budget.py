"""What the machine can give running steps (cores, memory, GPUs) and what each running step holds of it."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from qbuild.contract.step import Step


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def available_memory_mb() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("inf")


@dataclass
class Standby:
    """A worker started ahead of its step: it imports `preload` and waits on stdin for a step."""

    proc: subprocess.Popen
    read_fd: int     # its progress pipe (the worker writes to the other end)
    env: dict        # the variables it was started with; a step sends only those it needs changed
    preload: tuple[str, ...]
    for_keys: set[str]   # the waiting steps it was started for (a step started at once never needed it)


@dataclass
class Claim:
    """What a running step holds of the machine (Budget.claim); elastic steps' `cpus` grows and shrinks."""

    cpus: int
    memory_mb: float
    gpu: str | None
    alone: bool
    key: str = ""
    base: int = 0                      # the threads the step asked for (what an elastic step returns to)
    elastic: bool = False
    standby: Standby | None = None     # a worker started ahead for this step, if one was
    disk_bytes: int = 0                # what it is expected to write (output and scratch) while it runs
    group: str = ""                    # its Step.at_once group, if any


@dataclass
class Budget:
    """What the machine can give running steps; a step takes a claim and gives it back when it ends."""

    cpus: int            # free cores
    jobs: int
    memory_mb: float     # free memory
    gpus: list[str]      # free devices
    running: int = 0
    exclusive: bool = False
    # free bytes on the store's disk now (None: unknown); what running steps are expected to write is held
    # against it, so steps that each fit alone do not fill the disk together
    disk_free: Callable[[], int | None] = lambda: None
    disk_held: int = 0

    def __post_init__(self):
        self.cores = self.cpus
        self.in_group: dict[str, int] = {}   # Step.at_once group → its steps running now

    def claim(self, step: Step, memory_mb: float, alone: bool, disk_bytes: int = 0) -> Claim | None:
        threads = min(max(step.threads, 1), self.cores)  # a step wanting more cores than exist gets them all
        if self.exclusive or (alone and self.running) or self.running >= self.jobs:
            return None
        if self.running and (threads > self.cpus or memory_mb > self.memory_mb):
            return None
        if step.requires_gpu and not self.gpus and self.running:
            return None
        if step.at_once is not None and self.in_group.get(step.at_once[0], 0) >= step.at_once[1]:
            return None
        if self.running and disk_bytes and (free := self.disk_free()) is not None \
                and disk_bytes > free - self.disk_held:
            return None   # waits for a running step to finish; alone, it starts (and fails in one line if it cannot fit)
        claim = Claim(cpus=threads, memory_mb=memory_mb, gpu=self.gpus.pop(0) if step.requires_gpu and self.gpus
                      else None, alone=alone, key=step.key, base=threads, elastic=step.elastic_threads,
                      disk_bytes=disk_bytes, group=step.at_once[0] if step.at_once else "")
        if claim.group:
            self.in_group[claim.group] = self.in_group.get(claim.group, 0) + 1
        self.cpus -= threads
        self.memory_mb -= memory_mb
        self.disk_held += disk_bytes
        self.running += 1
        self.exclusive = alone
        return claim

    def take_back_idle_share(self, claims) -> None:
        """Every elastic step returns to its own threads, so a step about to start finds its cores free."""
        for c in claims:
            extra = c.cpus - c.base
            if extra > 0:
                self.cpus += extra
                c.cpus -= extra

    def share_idle(self, claims) -> None:
        """Hand cores no step could take to the running elastic steps, one at a time to the one with fewest."""
        elastic = [c for c in claims if c.elastic]
        while self.cpus > 0 and elastic and not self.exclusive:
            c = min(elastic, key=lambda c: c.cpus)
            if c.cpus >= self.cores:
                break
            c.cpus += 1
            self.cpus -= 1

    def release(self, claim: Claim) -> None:
        self.cpus += claim.cpus
        self.memory_mb += claim.memory_mb
        self.disk_held -= claim.disk_bytes
        if claim.group:
            self.in_group[claim.group] -= 1
        if claim.gpu is not None:
            self.gpus.append(claim.gpu)
        self.running -= 1
        self.exclusive = False
