"""Parametrisations (``model.parametrization``; the derivation: docs/parametrization.md).

``sp`` is the standard parametrisation, unchanged. ``mup`` (Yang et al., arXiv:2203.03466) scales
with width, ``completep`` (Dey et al., arXiv:2505.01618, Table 1) with width and depth, relative
to a base model: ``m_d = width / base_width``, ``m_L = depth / base_depth``, ``α = depth_alpha``
(mup: no depth factors). Every parameter has a role: the model's own by name, a mixer's by its
``param_roles``. A role's multipliers (``block/`` = inside the depth, ``top/`` = outside it):

| role | lr | weight decay | init std |
| --- | --- | --- | --- |
| ``embedding`` (the token table; tied, it also reads out the logits) | 1 | 1 | 1 |
| ``output`` (an untied LM head) | 1 | 1 | ``m_d^{1/2}`` |
| ``hidden``, ``readout`` (fan-in ∝ width) | ``m_d^-1 m_L^(α-1)`` | ``m_d`` | 1 |
| ``norm``, ``scalar`` (fan-in fixed) | ``m_L^(α-1)`` (``top/``: 1) | 1 | 1 |
| ``res`` (on the stream itself: ``H_res``, post-norm gains) | ``m_L^-1`` | 1 | 1 |
| ``res_readout`` (``H_res``'s projection, fan-in ∝ width) | ``m_d^-1 m_L^-1`` | ``m_d`` | 1 |

and Adam's ε ``× m_d^-1`` for every parameter, ``× m_L^-α`` more for those whose gradient
passes the branch multiplier (``block/`` roles other than ``res*``; Complete(d)P, arXiv:2512.22382,
Eq. 40: the embedding and unembedding take ``ε / m_d``), every branch output ``× m_L^-α``, the
logits ``× 1/m_d`` (both forms: ``h·W / (sqrt(base_width) m_d)``, ``W`` the tied embedding or
``sqrt(base_width)`` x the untied head, entries ~1), and with ``base_head_dim`` set the
attention logits ``× sqrt(base_head_dim / head_dim)`` (µP's ``1/head_dim``). The lr multipliers
act on Adam's update (optax ``multi_transform`` over the labels), the weight decay's on the decay
term inside it
(coupled: ``lr·wd``; independent: per step), so the decay a hidden matrix gets per step is
``m_L^(α-1)`` of the base's in both.
"""

from __future__ import annotations

import fnmatch

import jax
import optax

from mhc_jax import mixers
from mhc_jax.errors import ConfigError

ROLES = ("embedding", "output", "hidden", "readout", "norm", "scalar", "res", "res_readout")
MIXER_ROLES = ROLES[2:]  # what a mixer's param_roles may name
LABELS = tuple(f"{where}/{r}" for where in ("block", "top") for r in ROLES)
_MIXER_KEYS = ("attn_mix", "mlp_mix", "collapse")  # model.params.MIXER_KEYS (no import circle)


def factors(cfg) -> tuple[float, float, float]:
  """``(m_d, m_L, α)`` of a ModelConfig: ``(1, 1, 0)`` under sp; mup has ``m_L = 1, α = 0``."""
  m_d = 1.0 if cfg.parametrization == "sp" else cfg.width / cfg.base_width
  if cfg.parametrization != "completep":
    return m_d, 1.0, 0.0
  return m_d, cfg.depth / cfg.base_depth, float(cfg.depth_alpha)


def branch_multiplier(cfg) -> float:
  """Each sublayer's output (the branch the mixer writes) is multiplied by ``m_L^-α``."""
  _, m_l, alpha = factors(cfg)
  return m_l**-alpha


def logit_multiplier(cfg) -> float:
  """``1/m_d`` of the base's: tied logits ``h·E/sqrt(width)`` already have ``m_d^-1/2`` of it."""
  m_d = factors(cfg)[0]
  return m_d**-0.5 if cfg.tied_embeddings else 1.0 / m_d


def query_multiplier(cfg) -> float:
  """µP's ``1/head_dim`` attention, as a factor on the queries: logits ``q·k / sqrt(d)`` become
  ``q·k sqrt(b) / d`` (``b = base_head_dim``; equal to sp's at ``d = b``). 1 under sp or when
  ``base_head_dim`` is unset (the head dim held, heads growing with width)."""
  b = getattr(cfg, "base_head_dim", None)
  if cfg.parametrization == "sp" or b is None:
    return 1.0
  return (b / (cfg.width // cfg.heads)) ** 0.5


def multipliers(cfg, label: str) -> dict[str, float]:
  """``{"lr", "wd", "init", "eps"}`` of a label (``block/<role>`` or ``top/<role>``)."""
  where, role = label.split("/")
  m_d, m_l, alpha = factors(cfg)
  wide = role in ("hidden", "readout", "res_readout")
  # the branch path's updates reach the stream through m_L^-alpha; the stream path's (res*) act
  # on it directly, a product of 2L of them: 1/m_L each keeps their sum over depth O(1)
  depth = 1.0 if where == "top" else m_l ** (-1.0 if role.startswith("res") else alpha - 1)
  init = m_d**0.5 if role == "output" else 1.0
  # the gradient scales like 1/m_d everywhere, and like m_L^-alpha more through a branch
  branch = where == "block" and not role.startswith("res")
  eps = 1.0 / (m_d * (m_l**alpha if branch else 1.0))
  lr = depth / m_d if wide else depth
  return {"lr": lr, "wd": m_d if wide else 1.0, "init": init, "eps": eps}


def _keys(path) -> list[str]:
  return [str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey)]


def role(keys: list[str], mixer_roles: dict[str, str] | None) -> str | None:
  """The role of the parameter at dict-key path ``keys`` (None: it has none)."""
  name = keys[-1]
  if any(k in _MIXER_KEYS for k in keys):
    pats = (mixer_roles or {}).items()
    return next((r for pat, r in pats if fnmatch.fnmatchcase(name, pat)), None)
  own = {"embedding": "embedding", "scale": "norm", "kernel": "hidden"}.get(name)
  return "output" if own == "hidden" and "head" in keys else own


def labels(params, cfg):
  """A tree like ``params`` (boxed or not) of labels, ``block/<role>`` inside the blocks and
  ``top/<role>`` outside; a parameter without a role is a ConfigError naming the key."""
  roles = mixers.resolve(cfg.mixer).param_roles

  def label(path, _):
    keys = _keys(path)
    r = role(keys, roles)
    if r not in ROLES:
      has = "none" if r is None else f"{r!r}, not one of {', '.join(ROLES)}"
      raise ConfigError(
        f"model.parametrization: {cfg.parametrization} needs a role for every parameter; "
        f"{'/'.join(keys)} of mixer {cfg.mixer!r} has {has} (param_roles: docs/parametrization.md)"
      )
    inside = any(k == "blocks" or k.startswith("block_") for k in keys)
    return f"{'block' if inside else 'top'}/{r}"

  return jax.tree_util.tree_map_with_path(label, params)


def scale_by_role(cfg, adam: dict, weight_decay, decay_mask) -> optax.GradientTransformation:
  """Per label: ``(adam(g; ε·eps) + weight_decay·wd·p [where decay_mask]) · lr`` (the
  multipliers of :func:`multipliers`; ``adam``: optax.scale_by_adam's b1, b2, eps), one optax
  ``multi_transform`` over :func:`labels`. Where every label's ε is the same (mup; completep at
  its base depth) one Adam serves all, the program it compiled to before ε had roles."""
  eps = {l: multipliers(cfg, l)["eps"] for l in LABELS}

  def group(label, with_adam):
    m = multipliers(cfg, label)
    decay = optax.add_decayed_weights(weight_decay * m["wd"], mask=decay_mask)
    first = [optax.scale_by_adam(**{**adam, "eps": adam["eps"] * m["eps"]})] if with_adam else []
    return optax.chain(*first, decay, optax.scale(m["lr"]))

  shared = len(set(eps.values())) == 1
  roles = optax.multi_transform({l: group(l, not shared) for l in LABELS}, lambda p: labels(p, cfg))
  if not shared:
    return roles
  return optax.chain(optax.scale_by_adam(**{**adam, "eps": adam["eps"] * eps[LABELS[0]]}), roles)
