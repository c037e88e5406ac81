"""Randomness that protects someone, and randomness that may repeat.

Two sources, never mixed:

* :func:`secure_generator`: a torch generator seeded with 63 bits from the
  operating system's cryptographically secure source (``secrets``, i.e.
  ``os.urandom``). Nothing a run's parties exchange or configure determines
  it, so nobody can recompute what it draws. DP-SGD's noise and Poisson
  batches on a node, and client-level DP's noise on the server, use it.
* :func:`seeded_generator`: a generator seeded from values (the run seed, the
  round, the partition) that a run reproduces, for training randomness and
  for the labelled simulation option ``reproducible-noise``, whose epsilon is
  then no guarantee (anyone who knows the seed can subtract the noise).

A seeded Mersenne Twister or Philox stream is not a cryptographic generator:
seeding it from ``os.urandom`` stops a party from *replaying* the noise (the
attack DP's guarantee must survive here), not an attacker who sees enough
raw draws to reconstruct the generator's state; fedlr never publishes raw
draws, only their sums with the clients' gradients or updates. Opacus's
``secure_mode`` (torchcsprng) additionally resists floating-point attacks on
the Gaussian sampler; it needs a package that is not published for current
torch, so fedlr does not offer it (docs/privacy.md, "Honest limits").
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["os_seed", "secure_generator", "seeded_generator"]


def os_seed() -> int:
    """63 bits from the operating system's secure source."""
    return secrets.randbits(63)


def secure_generator(device: torch.device | str | None = None) -> torch.Generator:
    """A torch generator on ``device`` seeded by :func:`os_seed`."""
    generator = torch.Generator(device=device or "cpu")
    generator.manual_seed(os_seed())
    return generator


def seeded_generator(
    parts: Sequence[int], device: torch.device | str | None = None
) -> torch.Generator:
    """A torch generator seeded by a hash of ``parts`` (NumPy's SeedSequence:
    distinct tuples give unrelated streams)."""
    state = np.random.SeedSequence([int(p) % 2**63 for p in parts]).generate_state(2)
    seed = (int(state[0]) << 31 ^ int(state[1])) % 2**63
    generator = torch.Generator(device=device or "cpu")
    generator.manual_seed(seed)
    return generator
