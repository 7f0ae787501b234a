"""A Hugging Face pipeline plan with parameterless modules between embedding, layers and norm (GPT-NeoX's
`emb_dropout`, Phi's `embed_dropout`): the first stage holds and runs them after the embedding; a plan with weights
elsewhere is refused in one line. Exactness at pp2 x tp2 is in tests/test_family_sweep.py."""

from __future__ import annotations

import pytest
import torch
import transformers as T

from pp_tp import ParallelConfig
from pp_tp.errors import ConfigError
from pp_tp.layout import layout_for
from pp_tp.preflight.rules import PreflightInputs, preflight
from pp_tp.split.plan import StageSpec
from pp_tp.stages.stage_module import StageModule

SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=64)


def _neox(**kw) -> torch.nn.Module:
    torch.manual_seed(0)
    return T.GPTNeoXForCausalLM(T.GPTNeoXConfig(**SMALL, **kw))


def test_parameterless_plan_modules_run_in_the_first_stage():
    model = _neox(hidden_dropout=0.5)
    lay = layout_for(model)
    assert lay.first.modules == ("gpt_neox.embed_in", "gpt_neox.emb_dropout")
    assert lay.last.modules == ("gpt_neox.final_layer_norm", "lm_head")
    first = StageModule(model, lay, StageSpec(0, 0, True, [], False, list(lay.first.modules)))
    middle = StageModule(model, lay, StageSpec(1, 1, False, ["0"], False, [f"{lay.blocks}.0"]))
    assert "gpt_neox.emb_dropout" in dict(first.named_modules())
    assert "gpt_neox.emb_dropout" not in dict(middle.named_modules())
    ids = torch.randint(0, 64, (2, 8))
    embedded = model.gpt_neox.embed_in(ids)
    assert torch.equal(first.eval()(ids), embedded)
    dropped = first.train()(ids)
    assert torch.equal(dropped != 0, (dropped - 2 * embedded).abs() < 1e-6) and 0.2 < (dropped == 0).float().mean()


def test_a_plan_with_weights_between_its_parts_is_refused():
    class WithProjection(T.GPTNeoXForCausalLM):
        def __init__(self, config):
            super().__init__(config)
            self.gpt_neox.emb_dropout = torch.nn.Linear(32, 32)  # now weights between embedding and layers

    with torch.device("meta"):
        model = WithProjection(T.GPTNeoXConfig(**SMALL))
    with pytest.raises(ConfigError, match=r"is not embedding -> layers -> norm \(with only parameterless") as e:
        layout_for(model)
    assert "\n" not in str(e.value)


def test_weights_beside_the_language_model_are_refused():
    """A module with weights outside every module the layout places (a vision tower beside the language model)
    would leave training and checkpoints unnoticed: preflight refuses it in one line, naming the parameter."""
    model = _neox()
    model.vision_tower = torch.nn.Linear(8, 8)  # beside gpt_neox, as a multimodal model holds its image encoder
    with pytest.raises(ConfigError, match=r"parameter 'vision_tower.weight' lies outside every module") as e:
        preflight(model, ParallelConfig(pp=2), PreflightInputs("cpu"))
    assert "\n" not in str(e.value)
    preflight(_neox(), ParallelConfig(pp=2), PreflightInputs("cpu"))  # the plain model passes
