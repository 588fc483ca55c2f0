"""The exported torchrun script's activation checkpointing (``pipexplore.export.torchrun``): each
stage's forward per micro-batch as the plan says, on the cluster a plan is for."""
from __future__ import annotations

import copy
import types

import pytest
import torch
from torch import nn

from pipexplore.export.script_parts import checkpoint_stage, place_graph_devices
from pipexplore.export.torchrun import torchrun_script
from pipexplore.widgets.state import ExplorerState


class _Counted(nn.Module):
    """A stage's module that counts its forwards with autograd on."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4))
        self.forwards = 0

    def forward(self, x):
        self.forwards += torch.is_grad_enabled()
        return self.body(x)


def _step(mode: str, module: nn.Module, batch: torch.Tensor, chunks: int = 4) -> _Counted:
    """One step of ``chunks`` micro-batches through a stage whose module is a copy of ``module``,
    checkpointed by the script's own function, as torch's stage calls it: a forward without
    autograd first (as shape inference may), then every forward, then every backward."""
    stage = types.SimpleNamespace(submod=copy.deepcopy(module))
    checkpoint_stage(stage, chunks, mode)  # the exported script's function (its source is the script's)
    with torch.no_grad():
        stage.submod(batch[:1])
    outputs = [stage.submod(part) for part in batch.chunk(chunks)]
    for output in outputs:
        output.square().sum().backward()
    return stage.submod


@pytest.mark.parametrize("mode,forwards", [("never", 4), ("always", 8), ("except_last", 7)])
def test_a_checkpointed_stage_runs_its_forward_again_in_backward_with_the_same_gradients(mode, forwards):
    module, batch = _Counted(), torch.randn(8, 4)
    ran = _step(mode, module, batch)
    assert ran.forwards == forwards  # micro-batch forwards, and again in backward for each one checkpointed
    kept = _step("never", module, batch)
    for (name, ours), (_, theirs) in zip(ran.named_parameters(), kept.named_parameters(), strict=True):
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=0, atol=0, msg=name)


def test_an_export_for_catalogue_gpus_applies_the_plans_checkpointing_and_one_for_here_none():
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    batch = torch.randn(8, 8)
    planned = ExplorerState(model, batch, devices=["H100"] * 2, chunks=4, checkpoint="always", calibrate=False)
    script = planned.export("torchrun")
    assert "CHECKPOINT = 'always'" in script and "checkpoint_stage(stage, CHUNKS, CHECKPOINT)" in script
    compile(script, "train_pipeline.py", "exec")
    planned.update(checkpoint="except_last")
    assert "CHECKPOINT = 'except_last'" in planned.export("torchrun")
    here = ExplorerState(model, batch, devices=["cpu"] * 2, chunks=4, checkpoint="always", calibrate=False,
                         profile_repeats=1)
    # this machine's processes and the page's torchrun run torch's runtime without recomputation
    assert "CHECKPOINT = 'never'" in here.export("torchrun") and here.plan.run_checkpoint == "always"
    with pytest.raises(ValueError, match="checkpoint is not one of 'always', 'except_last', or 'never', got 'sometimes'"):
        torchrun_script(here.layer_table, [2], hooks="m", chunks=4, checkpoint="sometimes")


# ---- a model larger than a host: built on meta, each rank makes only its own stages real --------

#: What both hooks modules below share: the model built on meta, and a stage filled by its names
#: from the reference model's tensors (buffers too: a rotary inv_freq is in no state_dict).
ON_META = '''

def reference():
    torch.manual_seed(0)
    return _model()


def build_model():
    with torch.device("meta"):
        return _model()


def init_stage(module):  # a checkpoint's tensors, found by the model's names
    model = reference()
    tensors = {**dict(model.named_parameters(remove_duplicate=False)),
               **dict(model.named_buffers(remove_duplicate=False))}
    own = [*module.named_parameters(), *module.named_buffers()]
    for name, tensor in own:
        tensor.copy_(tensors[name])
    print("filled", ",".join(sorted(name for name, _ in own)), flush=True)
'''

META_HOOKS = '''
import torch
from torch import nn


def _model():
    return nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4)])


def get_batch():
    generator = torch.Generator().manual_seed(1)
    return torch.randn(8, 16, generator=generator), torch.randn(8, 16, generator=generator)


def loss_fn(output, target):
    return ((output - target) ** 2).mean()
''' + ON_META


def _planned_on_meta(tmp_path, hooks_source: str, name: str):
    """The plan of a model on the meta device for 2 planned GPUs, exported for torchrun, with its hooks."""
    (tmp_path / f"{name}.py").write_text(hooks_source)
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4)])
    planned = ExplorerState(model, torch.empty(8, 16, device="meta"), devices=["H100"] * 2, chunks=2,
                            schedule="1f1b", checkpoint="never", calibrate=False)
    planned.update(splits=[2])
    script = tmp_path / "train_pipeline.py"
    script.write_text(planned.export("torchrun", hooks=name))
    return script


def test_a_model_built_on_meta_trains_with_each_rank_holding_only_its_stages(tmp_path):
    from ranks import run_ranks

    script = _planned_on_meta(tmp_path, META_HOOKS, "meta_hooks")
    outputs = run_ranks(script, ["--device", "cpu"], ranks=2, pythonpath=str(tmp_path))
    filled = [line.split(" ", 1)[1] for out in outputs for line in out.splitlines() if line.startswith("filled ")]
    assert filled == ["0.0.bias,0.0.weight,1.0.bias,1.0.weight", "2.0.bias,2.0.weight,3.0.bias,3.0.weight"]
    namespace: dict = {}
    exec(META_HOOKS, namespace)  # noqa: S102 - the hooks, for the unsplit model at the same weights
    inputs, target = namespace["get_batch"]()
    expected = namespace["loss_fn"](namespace["reference"]()(inputs), target).item()
    loss = float(outputs[1].split("step 0 loss=")[1].split()[0])
    assert loss == pytest.approx(expected, rel=1e-5)


def test_a_model_on_meta_without_init_stage_is_refused_by_name(tmp_path):
    from ranks import run_ranks

    without = META_HOOKS.replace("def init_stage(module):", "def _not_init_stage(module):")
    script = _planned_on_meta(tmp_path, without, "meta_hooks_without")
    refusal = (r"build_model\(\) gave a model on the meta device, so each rank makes only its own stages real: "
               r"meta_hooks_without must define init_stage\(module\)")
    with pytest.raises(AssertionError, match=refusal):
        run_ranks(script, ["--device", "cpu"], ranks=2, pythonpath=str(tmp_path))


class _Rotary(nn.Module):
    """A buffer moved to its input's device in forward, as a rotary embedding's inv_freq is."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.register_buffer("inv_freq", torch.arange(1.0, 5.0), persistent=False)

    def forward(self, x):
        return self.linear(x) * self.inv_freq.to(x.device)


def _devices_in(module):
    found = set()
    for sub in module.modules():
        graph = getattr(getattr(sub, "graph_module", sub), "graph", None)
        for node in getattr(graph, "nodes", []):
            torch.fx.node.map_aggregate((node.args, node.kwargs),
                                        lambda v: found.add(str(v)) if isinstance(v, torch.device) else v)
    return found


@pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")  # torch's pipeline() copying its own specs
def test_a_device_the_trace_burned_in_positionally_is_moved_to_the_ranks():
    """Traced on the CPU, run elsewhere (a GPU on the cluster; the meta device here): before, the
    buffer went back to the traced device at every forward."""
    from torch.distributed.pipelining import pipeline

    stage = pipeline(_Rotary(), mb_args=(torch.randn(2, 4),), split_spec={}).get_stage_module(0)
    assert _devices_in(stage) == {"cpu"}
    with pytest.raises(RuntimeError, match="meta"):
        stage.to("meta")(torch.empty(2, 4, device="meta"))
    place_graph_devices(stage, torch.device("cpu"), torch.device("meta"))  # the exported script's function
    assert _devices_in(stage) == {"meta"}
    assert stage(torch.empty(2, 4, device="meta")).device.type == "meta"
    place_graph_devices(stage, torch.device("meta"), torch.device("meta"))  # nothing to move
    assert _devices_in(stage) == {"meta"}


LLAMA_HOOKS = '''
import torch
import transformers
from torch.nn import functional as F


def build_model():
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def get_batch():
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    return ids, ids


def loss_fn(output, target):  # the model's output as it returns it: a ModelOutput
    return F.cross_entropy(output["logits"].flatten(0, 1), target.flatten())
'''


def test_the_exported_scripts_loss_sees_the_model_output_as_the_explorer_does(tmp_path):
    """One loss function, one output structure, wherever it runs: a traced Hugging Face model's
    exported script hands loss_fn a ModelOutput, and its first loss equals the unsplit model's."""
    from ranks import run_ranks

    (tmp_path / "llama_hooks.py").write_text(LLAMA_HOOKS)
    namespace: dict = {}
    exec(LLAMA_HOOKS, namespace)  # noqa: S102
    model = namespace["build_model"]()
    ids, target = namespace["get_batch"]()
    expected = namespace["loss_fn"](model(ids), target).item()
    state = ExplorerState(model, ids, target=target, loss_fn=namespace["loss_fn"], devices=["cpu", "cpu"], chunks=2,
                          schedule="1f1b", calibrate=False, profile_repeats=1)
    script = tmp_path / "train_pipeline.py"
    script.write_text(state.export("torchrun", hooks="llama_hooks"))
    outputs = run_ranks(script, ["--device", "cpu"], ranks=2, pythonpath=str(tmp_path))
    loss = float(outputs[1].split("step 0 loss=")[1].split()[0])
    assert loss == pytest.approx(expected, rel=1e-5)
