"""A count that raises leaves nothing behind: no global module hook, dispatch mode or process group
(the suite's autouse check, ``tests/conftest.py``, holds every test to the same)."""
from __future__ import annotations

import warnings

import pytest
import torch
import transformers
from torch import nn

from conftest import global_state
from pipexplore.models.meta import count_layers


class _Raises(nn.Module):
    def forward(self, x):
        raise RuntimeError("this block cannot run")


def _llama_whose_second_block_raises():
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.LlamaForCausalLM(config)
    model.model.layers[1].mlp = _Raises()
    return model


def _state():
    state = global_state()
    state.pop("threads")
    return state


@pytest.mark.parametrize("tp", [1, 2])
def test_a_count_that_raises_removes_what_it_installed(tp):
    before = _state()
    ids = torch.zeros(2, 16, dtype=torch.long, device="meta")
    with pytest.raises(Exception, match="this block cannot run"):
        count_layers(_llama_whose_second_block_raises(), ids, tp=tp)
    assert _state() == before
    assert before["dispatch modes"] == 0 and before["process group"] is False


def test_a_sequential_whose_layer_raises_on_meta_leaves_nothing():
    before = _state()
    with pytest.raises(Exception, match="this block cannot run"):
        with torch.device("meta"):
            model = nn.Sequential(nn.Linear(8, 8), _Raises())
        count_layers(model, torch.zeros(4, 8, device="meta"))
    assert _state() == before


def test_the_thread_check_leaves_a_module_the_threads_it_names_and_reports_any_other():
    import threading

    from conftest import _left_threads

    before = {t.ident: t.name for t in threading.enumerate()}
    stop = threading.Event()
    threads = [threading.Thread(target=stop.wait, name=name, daemon=True) for name in ("asyncio_3", "a-worker")]
    for thread in threads:
        thread.start()
    try:
        assert sorted(_left_threads(before, grace=0.0).values()) == ["a-worker", "asyncio_3"]
        assert list(_left_threads(before, grace=0.0, kept=("asyncio_",)).values()) == ["a-worker"]
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    assert _left_threads(before, grace=1.0) == {}
