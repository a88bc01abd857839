"""transformers' Llama with its projections through :func:`~hf_hybrid.layers.projections.project_few_rows`.

Our models' decode steps send their skinny matmuls (a few rows: the batch) through the few-row
projection kernel; the generate() benchmark's Llama baseline must get every backbone optimisation
our models get, so its ``llama_projections`` row runs Llama's decode step through the same kernel.

:func:`apply_few_row_projections_to_llama` gives every ``LlamaAttention`` and ``LlamaMLP`` of a
Llama model a per-instance forward (the class stays untouched): q/k/v in one ``project_few_rows``
call, o_proj in a call of its own, gate/up in one call and down_proj in one. Everything else is
transformers' own computation, statement for statement (rotary, cache update, attention interface,
scaling, dropout, reshapes), so outputs are unchanged where the kernel does not apply (CPU, a
gradient, many rows: project_few_rows calls the modules) and equal to rounding where it does. The
installed forwards are checked against the code followed here (transformers 5.17 to 5.24) before
anything is patched. Nothing here breaks the graph: generate() can still compile the static-cache
decode step with fullgraph (the kernel is a registered custom op).
"""
from __future__ import annotations

import ast
import inspect
import textwrap
import types

import torch
from torch import nn
from transformers.models.llama import modeling_llama

from hf_hybrid.layers.projections import project_few_rows

# LlamaAttention.forward's body in transformers 5.17 (whitespace and comments do not count). 5.24
# renames the cache argument to `cache` and passes `kwargs=kwargs` to its update: the placeholders.
_ATTENTION_BODY = """
input_shape = hidden_states.shape[:-1]
hidden_shape = (*input_shape, -1, self.head_dim)
query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
cos, sin = position_embeddings
query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
if {cache} is not None:
    key_states, value_states = {cache}.update(key_states, value_states, self.layer_idx{update_kwargs})
attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
    self.config._attn_implementation, eager_attention_forward
)
attn_output, attn_weights = attention_interface(
    self, query_states, key_states, value_states, attention_mask,
    dropout=0.0 if not self.training else self.attention_dropout, scaling=self.scaling, **kwargs,
)
attn_output = attn_output.reshape(*input_shape, -1).contiguous()
attn_output = self.o_proj(attn_output)
return attn_output, attn_weights
"""
_MLP_BODY = """
down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
return down_proj
"""
_CACHE_NAMES = ("past_key_values", "cache")
_UPDATE_KWARGS = ("", ", kwargs=kwargs")

# Whether the installed LlamaAttention passes its kwargs on to cache.update (5.24 does, 5.17 does
# not): read off its source when a model is patched, so the replacement passes the same.
_update_passes_kwargs = False


def _statements(source: str) -> list[str]:
    """The statements of ``source`` as ast.unparse writes them: formatting and comments do not count."""
    return [ast.unparse(statement) for statement in ast.parse(textwrap.dedent(source)).body]


def _forward_statements(cls: type) -> tuple[list[str], list[str]]:
    """(parameter names, body statements without the docstring) of ``cls.forward`` as installed."""
    forward = inspect.unwrap(cls.forward)  # 5.24's cache-rename decorator wraps it
    try:
        function = ast.parse(textwrap.dedent(inspect.getsource(forward))).body[0]
    except (OSError, TypeError) as error:
        raise RuntimeError(f"apply_few_row_projections_to_llama: cannot read the source of {cls.__name__}.forward "
                           f"to check it ({error}).") from error
    body = function.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return list(inspect.signature(forward).parameters), [ast.unparse(statement) for statement in body]


def _unsupported(cls: type, what: str) -> RuntimeError:
    import transformers

    return RuntimeError(
        f"apply_few_row_projections_to_llama: transformers {transformers.__version__}'s {cls.__name__}.forward "
        f"{what}; the replacement in benchmarks/llama_projections.py follows transformers 5.17 to 5.24. "
        "Update it to the installed forward before timing a Llama baseline with it."
    )


def _check_installed_llama() -> None:
    """Raise unless the installed LlamaAttention / LlamaMLP forwards are the code the replacements
    below follow (one of the cache spellings); record how the cache update is called."""
    global _update_passes_kwargs
    params, body = _forward_statements(modeling_llama.LlamaAttention)
    variants = {
        (cache, bool(update)): _statements(_ATTENTION_BODY.format(cache=cache, update_kwargs=update))
        for cache in _CACHE_NAMES for update in _UPDATE_KWARGS
    }
    matches = [key for key, statements in variants.items() if statements == body]
    if not matches:
        raise _unsupported(modeling_llama.LlamaAttention, "is not the code this patch reproduces")
    cache, passes_kwargs = matches[0]
    if params != ["self", "hidden_states", "position_embeddings", "attention_mask", cache, "kwargs"]:
        raise _unsupported(modeling_llama.LlamaAttention, f"takes {params}")
    if _forward_statements(modeling_llama.LlamaMLP) != (["self", "x"], _statements(_MLP_BODY)):
        raise _unsupported(modeling_llama.LlamaMLP, "is not the code this patch reproduces")
    _update_passes_kwargs = passes_kwargs


def _attention_forward(
    self,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    attention_mask: torch.Tensor | None = None,
    past_key_values=None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """LlamaAttention.forward (_ATTENTION_BODY) with q/k/v in one project_few_rows call and o_proj in one."""
    # 5.24 passes the cache as `cache` (its own forward maps `past_key_values` onto it).
    cache = kwargs.pop("cache", None) if past_key_values is None else past_key_values
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)

    query_states, key_states, value_states = project_few_rows(hidden_states, (self.q_proj, self.k_proj, self.v_proj))
    query_states = query_states.view(hidden_shape).transpose(1, 2)
    key_states = key_states.view(hidden_shape).transpose(1, 2)
    value_states = value_states.view(hidden_shape).transpose(1, 2)

    cos, sin = position_embeddings
    query_states, key_states = modeling_llama.apply_rotary_pos_emb(query_states, key_states, cos, sin)

    if cache is not None:
        update_kwargs = {"kwargs": kwargs} if _update_passes_kwargs else {}
        key_states, value_states = cache.update(key_states, value_states, self.layer_idx, **update_kwargs)

    attention_interface = modeling_llama.ALL_ATTENTION_FUNCTIONS.get_interface(
        self.config._attn_implementation, modeling_llama.eager_attention_forward
    )
    attn_output, attn_weights = attention_interface(
        self,
        query_states,
        key_states,
        value_states,
        attention_mask,
        dropout=0.0 if not self.training else self.attention_dropout,
        scaling=self.scaling,
        **kwargs,
    )

    attn_output = attn_output.reshape(*input_shape, -1).contiguous()
    attn_output = project_few_rows(attn_output, (self.o_proj,))[0]
    return attn_output, attn_weights


def _mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    """LlamaMLP.forward (_MLP_BODY) with gate/up in one project_few_rows call and down_proj in one."""
    gate, up = project_few_rows(x, (self.gate_proj, self.up_proj))
    return project_few_rows(self.act_fn(gate) * up, (self.down_proj,))[0]


def _set_forward(module: nn.Module, forward) -> None:
    """Give ``module`` ``forward`` as its own (per-instance) forward; again is a no-op."""
    own = vars(module).get("forward")
    if own is not None and getattr(own, "__func__", None) is not forward:
        # accelerate's hooks (device_map, offloading) and other patches install their own forward: ours would drop them
        raise RuntimeError(f"apply_few_row_projections_to_llama: {type(module).__name__} already has a per-instance "
                           "forward (accelerate hooks or another patch); patch the model before adding those.")
    module.forward = types.MethodType(forward, module)


def apply_few_row_projections_to_llama(model: nn.Module) -> nn.Module:
    """Route the projections of every LlamaAttention and LlamaMLP of ``model`` (a transformers Llama
    model, e.g. LlamaForCausalLM) through project_few_rows, in place; returns ``model``."""
    if not isinstance(model, modeling_llama.LlamaPreTrainedModel):
        raise TypeError(f"apply_few_row_projections_to_llama: expected a transformers Llama model "
                        f"(LlamaPreTrainedModel, e.g. LlamaForCausalLM), got {type(model).__name__}.")
    # Exact types: a subclass may have a forward of its own, which ours would replace.
    attentions = [m for m in model.modules() if type(m) is modeling_llama.LlamaAttention]
    mlps = [m for m in model.modules() if type(m) is modeling_llama.LlamaMLP]
    if not attentions or not mlps:
        raise TypeError(f"apply_few_row_projections_to_llama: {type(model).__name__} has no LlamaAttention / "
                        "LlamaMLP modules to patch.")
    _check_installed_llama()
    for module in attentions:
        _set_forward(module, _attention_forward)
    for module in mlps:
        _set_forward(module, _mlp_forward)
    return model
