"""adapter_config.json: which PEFT LoraConfig options the pool serves, and what an adapter targets.

The pool serves plain LoRA: `y = x W + scaling * B (A x)` on the base model's
linear projections, one rank and one scaling per adapter. Every option of
PEFT 0.21's `LoraConfig` (and `PeftConfig`) is in `OPTIONS`, as one of:

- served: the option is read, and the adapter is served as PEFT serves it;
- inert: it does not change what a loaded adapter computes (training-only,
  bookkeeping, or the settings of an initialisation that left the base model as
  it was);
- refused: PEFT computes something the pool cannot (a rewritten base model, an
  extra tensor, a different formula); the refusal names the option, the cause
  and a fix that works.

An option this table does not know (a newer PEFT's) is refused unless it is
off (null, false, empty), since nothing here can tell whether it changes the
math. docs/adapters.md is this table for users.

Which modules an adapter targets is resolved from `target_modules` as PEFT
resolves it when it loads the adapter (`check_target_module_exists` and
`_maybe_include_all_linear_layers` in peft/tuners/tuners_utils.py) against the
module names of transformers' `LlamaForCausalLM`: names, suffixes and full
paths in a list, a regex string matched with re.fullmatch, `all-linear`,
`exclude_modules`, `layers_to_transform` and `layers_pattern`.
"""
from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from shared.config import POOL_DTYPE_MAX
from shared.errors import CodedError, short_int
from shared.projections import MODULE_PARENT, MODULES

MERGE_FIX = ("or merge it into the base model (PeftModel.merge_and_unload(), then save_pretrained) "
             "and configure a pool on the merged model")
CONVERT_FIX = ("convert it to plain LoRA: save the trained adapter with model.save_pretrained(out, "
               "path_initial_model_for_weight_conversion=INITIAL) where INITIAL is the adapter "
               "saved right after initialisation, before training (PEFT writes a plain LoRA "
               "adapter of rank 2r), and load that")
# What PEFT's `target_modules=None` means for a Llama model (TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING).
DEFAULT_TARGETS = ("q_proj", "v_proj")
ALL_LINEAR = "all-linear"
# Longest regex accepted in target_modules, exclude_modules, layers_pattern and the pattern keys.
MAX_PATTERN_CHARS = 1024


class ConfigRefused(CodedError, ValueError):
    """An adapter_config.json the pool cannot serve as PEFT would; the message says what to change."""


def _unsupported(option: str, why: str, fix: str) -> ConfigRefused:
    return ConfigRefused("unsupported", f"{option} is not supported: {why}; {fix}")


def _invalid(what: str) -> ConfigRefused:
    return ConfigRefused("invalid_adapter", what)


def brief_repr(value: Any) -> str:
    """`value` as a message shows it: its repr, cut to 80 characters; an integer of more than
    24 digits as its first and last digits and how many there are."""
    if type(value) is int:  # JSON's integers are within Python's limit for str()
        return short_int(value)
    try:
        text = repr(value)
    except RecursionError:  # JSON nested nearly as deep as the decoder allows
        return "(a deeply nested value)"
    return text if len(text) <= 80 else text[:77] + "..."


# ---- the options ------------------------------------------------------------------------------

SERVED = ("r", "lora_alpha", "use_rslora", "target_modules", "exclude_modules",
          "layers_to_transform", "layers_pattern", "rank_pattern", "alpha_pattern",
          "init_lora_weights", "bias", "fan_in_fan_out")
INERT = ("peft_type", "task_type", "base_model_name_or_path", "revision", "inference_mode",
         "auto_mapping", "peft_version", "lora_dropout", "runtime_config", "megatron_core",
         "qalora_group_size", "loftq_config", "eva_config", "corda_config", "lora_ga_config",
         "ensure_weight_tying")
# option -> (why the pool cannot serve it, the fix), refused when the option is on.
REFUSED: dict[str, tuple[str, str]] = {
    "use_dora": ("DoRA rescales each module's output by a learned magnitude vector that the pool "
                 "does not hold", f"retrain with use_dora=false, {MERGE_FIX}"),
    "lora_bias": ("it trains a bias on lora_B that the pool does not hold",
                  f"retrain with lora_bias=false, {MERGE_FIX}"),
    "modules_to_save": ("the adapter carries whole trained copies of those modules, and the pool "
                        "holds only LoRA matrices",
                        f"retrain without modules_to_save, {MERGE_FIX}"),
    "trainable_token_indices": ("it trains rows of the token embeddings, and the pool holds only "
                                "LoRA matrices of the linear projections",
                                f"retrain without trainable_token_indices, {MERGE_FIX}"),
    "layer_replication": ("it rebuilds the base model's stack of layers, which a pool's base model "
                          "cannot change", "retrain on the base model without layer_replication"),
    "megatron_config": ("the adapter was built for Megatron's parallel layers",
                        "export it from a Hugging Face model with a plain LoraConfig"),
    "use_qalora": ("QALoRA applies lora_A to group-pooled inputs, not to the inputs themselves",
                   f"retrain with use_qalora=false, {MERGE_FIX}"),
    "target_parameters": ("it puts LoRA on raw parameters, and the pool serves LoRA on the linear "
                          "projections only", "retrain with target_modules instead"),
    "alora_invocation_tokens": ("Activated LoRA applies only after its invocation tokens, and the "
                                "pool applies an adapter to every token of a request",
                                "retrain as a plain LoRA adapter (without alora_invocation_tokens)"),
    "velora_config": ("VeLoRA saves compression buffers next to the LoRA weights",
                      f"retrain without velora_config, {MERGE_FIX}"),
    "monteclora_config": ("MonteCLoRA samples its LoRA weights", "retrain as a plain LoRA adapter"),
    "use_bdlora": ("BD-LoRA's block-diagonal factors are not the pool's dense A and B",
                   f"retrain without use_bdlora, {MERGE_FIX}"),
    "arrow_config": ("Arrow routes each token among several adapters",
                     "load each expert adapter on its own"),
    "kasa_config": ("KaSA truncates singular values of the base weights and adds a learned diagonal",
                    f"retrain without kasa_config, {MERGE_FIX}"),
}
# init_lora_weights values: how the adapter was initialised. Those that rewrite the base
# weights (W - B0 A0, or a quantised W) are refused: PEFT rewrites them again on load, so B A
# added to the pool's unmodified base model is not what PEFT computes, nor what was trained.
INIT_SERVED = (True, False, "gaussian", "eva", "orthogonal", "mica")
INIT_REWRITES_BASE = ("pissa", "olora", "corda", "lora_ga")  # "pissa_niter_N" too
OPTIONS = SERVED + INERT + tuple(REFUSED)
# Inits that leave a LoRA term of zero (B or A zero) where the weights lack a selected module,
# as PEFT leaves it at load; the others (false, "orthogonal") leave random weights there.
INIT_ZERO = (True, "gaussian", "eva", "mica")


def _on(value: Any) -> bool:
    return value not in (None, False, 0, "", [], {})


def _beyond_float(value: Any) -> bool:
    """A JSON integer too large for a float (309 digits or more)."""
    if type(value) is not int:
        return False
    try:
        float(value)
    except OverflowError:
        return True
    return False


def alpha_problem(value: Any, option: str) -> str | None:
    """Why `value` cannot be a lora_alpha: not a positive number, or beyond any float; None
    otherwise (load then checks its scaling, lora_alpha / r, in the pool's dtype). The one
    rule for `lora_alpha` and `alpha_pattern` values (statesvc/adapters.py `_rank_alpha`)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        return f"{option} must be a positive number, got {brief_repr(value)}"
    if _beyond_float(value) or value == math.inf:
        return (f"{option} {brief_repr(value)} is beyond float32's range (at most "
                f"{POOL_DTYPE_MAX['float32']:.6g}), in which the pool computes the scaling "
                "lora_alpha / r; use a lora_alpha of at most that times r (PEFT's default is 8)")
    return None


def refuse_unsupported(cfg: Mapping[str, Any], *, base_has_bias: bool) -> None:
    """Raise ConfigRefused for any option of `cfg` that changes what PEFT computes in a way the
    pool cannot serve. `base_has_bias`: the base model's projections have biases."""
    peft_type = cfg.get("peft_type")
    if peft_type != "LORA":
        raise _invalid(f"peft_type is {brief_repr(peft_type)}; only LORA adapters are supported "
                       "(train a LoRA adapter: peft_type LORA)")
    unknown = sorted(k for k in cfg if k not in OPTIONS and _on(cfg[k]))
    if unknown:
        raise _unsupported(f"option {brief_repr(unknown[0])}", "it is not an option of PEFT "
                           "0.21's LoraConfig, so whether it changes the adapter's output is "
                           "unknown",
                           "remove it from adapter_config.json if the adapter does not use it")
    for option, (why, fix) in REFUSED.items():
        if _on(cfg.get(option)):
            raise _unsupported(f"{option}={brief_repr(cfg[option])}", why, fix)
    _check_init(cfg.get("init_lora_weights", True))
    bias = cfg.get("bias", "none")
    if bias not in ("none", "all", "lora_only"):
        raise _invalid(f"bias must be 'none', 'all' or 'lora_only', got {brief_repr(bias)}")
    if bias != "none" and base_has_bias:
        raise _unsupported(f"bias={bias!r}", "the adapter carries trained copies of the base "
                           "model's biases, which the pool does not hold",
                           f"retrain with bias='none', {MERGE_FIX}")
    if not isinstance(cfg.get("fan_in_fan_out", False), bool):
        raise _invalid("fan_in_fan_out must be true or false, got "
                       f"{brief_repr(cfg['fan_in_fan_out'])}")


def unloaded_is_zero(cfg: Mapping[str, Any]) -> bool:
    """Whether a module that target_modules selects but the weights lack adds nothing in PEFT."""
    init = cfg.get("init_lora_weights", True)
    return init is True or (isinstance(init, str) and init in INIT_ZERO)


def _check_init(init: Any) -> None:
    if init is True or init is False or (isinstance(init, str) and init in INIT_SERVED):
        return
    if isinstance(init, str) and init.lower().startswith(INIT_REWRITES_BASE):
        raise _unsupported(f"init_lora_weights={init!r}", "that initialisation rewrites the base "
                           "model's weights, and PEFT rewrites them again when it loads the "
                           "adapter, so the adapter's B·A does not apply to the unmodified base "
                           "model", CONVERT_FIX)
    if init == "loftq":
        raise _unsupported("init_lora_weights='loftq'", "LoftQ trains against a quantised copy of "
                           "the base weights", "configure a pool on the base model LoftQ saved "
                           "for this adapter, or retrain with init_lora_weights=true")
    raise _invalid(f"init_lora_weights {brief_repr(init)} is not one of PEFT's; the pool serves "
                   f"{', '.join(map(repr, INIT_SERVED))} and refuses "
                   f"{', '.join(map(repr, INIT_REWRITES_BASE + ('loftq',)))}")


# ---- the modules an adapter targets ---------------------------------------------------------

LINEAR_OUTSIDE_LAYERS = ("lm_head",)  # a Linear, but the output embedding: not in all-linear
EMBEDDING = "model.embed_tokens"


def module_names(num_layers: int) -> list[str]:
    """`LlamaForCausalLM.named_modules()` names (without the root ""), in their order."""
    names = ["model", EMBEDDING, "model.layers"]
    for i in range(num_layers):
        p = f"model.layers.{i}"
        names += [p, f"{p}.self_attn", *(f"{p}.self_attn.{m}" for m in MODULES
                                        if MODULE_PARENT[m] == "self_attn"),
                  f"{p}.mlp", *(f"{p}.mlp.{m}" for m in MODULES if MODULE_PARENT[m] == "mlp"),
                  f"{p}.mlp.act_fn", f"{p}.input_layernorm", f"{p}.post_attention_layernorm"]
    return names + ["model.norm", "model.rotary_emb", *LINEAR_OUTSIDE_LAYERS]


_PROJECTION_RE = re.compile(r"model\.layers\.(0|[1-9][0-9]*)\.(self_attn|mlp)\.([a-z_]+)")


def _projection(name: str) -> tuple[int, str] | None:
    m = _PROJECTION_RE.fullmatch(name)
    if m is None or MODULE_PARENT.get(m.group(3)) != m.group(2):
        return None
    return int(m.group(1)), m.group(3)


def _strings(value: Any, option: str) -> list[str] | str | None:
    """`value` as PEFT takes it: None, a string (a regex) or a list of strings."""
    if value is None:
        return None
    if isinstance(value, str):
        _compile(value, option)
        return value
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return value
    raise _invalid(f"{option} must be a string or a list of strings, got {brief_repr(value)}")


def _compile(pattern: str, option: str) -> re.Pattern[str]:
    if len(pattern) > MAX_PATTERN_CHARS:
        raise _invalid(f"{option} holds a regex of {len(pattern)} characters, above the "
                       f"{MAX_PATTERN_CHARS}-character limit")
    try:
        return re.compile(pattern)
    except (re.error, RecursionError, OverflowError) as exc:
        raise _invalid(f"{option} {brief_repr(pattern)} is not a valid regex ({exc})") from None


def _suffixes(key: str) -> Iterable[str]:
    """Every dotted suffix of `key` shorter than it: a.b.c -> b.c, c."""
    parts = key.split(".")
    return (".".join(parts[i:]) for i in range(1, len(parts)))


@dataclass(frozen=True)
class _Matcher:
    """PEFT's `check_target_module_exists` for one LoraConfig (modules_to_save refused before)."""

    targets: str | frozenset[str]
    all_linear: bool  # every Linear but the output embedding, whatever the layers
    exclude: str | frozenset[str] | None
    layers: int | frozenset[int] | None
    layers_pattern: tuple[str, ...]

    def excluded(self, key: str) -> bool:
        if self.exclude is None:
            return False
        if isinstance(self.exclude, str):
            return re.fullmatch(self.exclude, key) is not None
        return key in self.exclude or any(s in self.exclude for s in _suffixes(key))

    def matches(self, key: str) -> bool:
        if self.all_linear:
            return _projection(key) is not None
        if isinstance(self.targets, str):
            return re.fullmatch(self.targets, key) is not None
        if key in self.targets:  # named in full: layers_to_transform does not apply
            return True
        if not any(s in self.targets for s in _suffixes(key)):
            return False
        if self.layers is None:
            return True
        match = None
        if not self.layers_pattern:
            match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", key)
        for pattern in self.layers_pattern:
            match = re.match(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", key)
            if match is not None:
                break
        if match is None:
            return False
        index = int(match.group("idx"))
        return index == self.layers if isinstance(self.layers, int) else index in self.layers


def _matcher(cfg: Mapping[str, Any]) -> _Matcher:
    targets = _strings(cfg.get("target_modules"), "target_modules")
    if targets is None:
        targets = list(DEFAULT_TARGETS)
    exclude = _strings(cfg.get("exclude_modules"), "exclude_modules")
    layers = cfg.get("layers_to_transform")
    # LoraConfig.__post_init__'s own refusals
    if isinstance(targets, str) and (layers is not None or cfg.get("layers_pattern") is not None):
        raise _invalid("layers_to_transform and layers_pattern do not apply to a target_modules "
                       "string (PEFT refuses this config too); list the modules instead")
    if cfg.get("layers_pattern") and layers is None:
        raise _invalid("layers_pattern needs layers_to_transform (PEFT refuses this config too)")
    if isinstance(layers, list) and not layers:
        layers = None
    if not (layers is None or type(layers) is int
            or (isinstance(layers, list) and all(type(i) is int for i in layers))):
        raise _invalid(f"layers_to_transform must be an integer or a list of integers, got "
                       f"{brief_repr(layers)}")
    pattern = _strings(cfg.get("layers_pattern"), "layers_pattern") or []
    pattern = [pattern] if isinstance(pattern, str) else pattern
    for p in pattern:
        _compile(rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.", "layers_pattern")
    return _Matcher(targets=targets if isinstance(targets, str) else frozenset(targets),
                    all_linear=isinstance(targets, str) and targets.lower() == ALL_LINEAR,
                    exclude=exclude if exclude is None or isinstance(exclude, str)
                    else frozenset(exclude),
                    layers=layers if layers is None or isinstance(layers, int) else frozenset(layers),
                    layers_pattern=tuple(pattern))


def resolve_targets(cfg: Mapping[str, Any], *, num_layers: int) -> frozenset[tuple[int, str]]:
    """The (layer, module) pairs PEFT puts LoRA on when it loads this adapter into the base model;
    raises ConfigRefused where PEFT would refuse, or would target a module the pool cannot serve."""
    matcher = _matcher(cfg)
    pairs: set[tuple[int, str]] = set()
    for key in module_names(num_layers):
        if matcher.excluded(key) or not matcher.matches(key):
            continue
        where = _projection(key)
        if where is not None:
            pairs.add(where)
        elif key in (EMBEDDING, *LINEAR_OUTSIDE_LAYERS):
            raise _unsupported(f"LoRA on {key.rsplit('.', 1)[-1]}",
                               f"target_modules {brief_repr(cfg.get('target_modules'))} selects "
                               f"{key}, and the pool holds LoRA for the layers' projections "
                               f"({', '.join(MODULES)}) only",
                               f"retrain with target_modules naming only those, {MERGE_FIX}")
        else:
            raise _invalid(f"target_modules {brief_repr(cfg.get('target_modules'))} selects "
                           f"{key}, which is not a linear layer (PEFT refuses this adapter "
                           "too); name the projections, e.g. q_proj, self_attn.q_proj or "
                           "model.layers.0.self_attn.q_proj")
    if not pairs:
        raise _invalid(f"target_modules {brief_repr(cfg.get('target_modules'))} (with "
                       "exclude_modules and layers_to_transform) selects no module of the base "
                       "model, so PEFT refuses this adapter too; modules are named like "
                       "model.layers.0.self_attn.q_proj (without a base_model.model. prefix), "
                       "and a suffix such as q_proj or self_attn.q_proj selects it in every layer")
    _check_patterns(cfg, pairs)
    return frozenset(pairs)


def _check_patterns(cfg: Mapping[str, Any], pairs: set[tuple[int, str]]) -> None:
    """rank_pattern and alpha_pattern as PEFT applies them (peft.utils.other.get_pattern_key):
    served only while every targeted module keeps r and lora_alpha, since the pool records one
    rank and one scaling per adapter."""
    for option, default in (("rank_pattern", cfg.get("r")), ("alpha_pattern", cfg.get("lora_alpha"))):
        pattern = cfg.get(option) or {}
        if not isinstance(pattern, dict):
            raise _invalid(f"{option} must be an object, got {brief_repr(pattern)}")
        keys = list(pattern)
        for k in keys:
            _compile(rf"(.*\.)?({k})$", option)
        for layer, module in sorted(pairs):
            name = f"model.layers.{layer}.{MODULE_PARENT[module]}.{module}"
            key = next((k for k in keys if re.match(rf"(.*\.)?({k})$", name)), None)
            if key is None or pattern[key] == default:
                continue
            what = "rank" if option == "rank_pattern" else "lora_alpha"
            top = "r" if option == "rank_pattern" else "lora_alpha"
            value, entry = pattern[key], f"{option}[{brief_repr(key)}]"
            if option == "rank_pattern" and (type(value) is not int or value < 1):
                raise _invalid(f"{entry}: a rank must be a positive integer, got "
                               f"{brief_repr(value)}")
            problem = (alpha_problem(value, f"{entry}: a lora_alpha")
                       if option == "alpha_pattern" else None)
            if problem:
                raise _invalid(problem)
            raise _unsupported(f"{option} {brief_repr({key: pattern[key]})}",
                               f"it gives {name} {what} {brief_repr(pattern[key])} where the "
                               f"adapter's {top} is {brief_repr(default)}, and the pool holds one "
                               "rank and one scaling per adapter",
                               "rewrite the adapter with one r and lora_alpha: pad every module's "
                               "lora_A and lora_B with zeros to the largest rank, multiply each "
                               "module's lora_B by its own scaling divided by the new one, and set "
                               "r, lora_alpha and empty patterns in adapter_config.json")
