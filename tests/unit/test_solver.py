"""slapo.sharding.Solver, upstream's automatic sharding: the optimum of small graphs worked out
by hand under upstream's cost model, the primitives it suggests, its errors, and that z3 stays
out of ``import slapo``."""
import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from tiny_modules import MLP
from torch import nn

import slapo
from slapo.sharding import Solver
from slapo.sharding.solver import RR, RS, SR, UnsupportedOpError, reshard_cost

pytest.importorskip("z3")

BS, SEQ, HIDDEN, HEADS = 2, 16, 32, 4


def traced(module):
    sch = slapo.create_schedule(module)
    sch.trace()
    return sch.mod


class Attention(nn.Module):
    """Self-attention as transformers 4 wrote it (view, permute, q @ k^T, softmax, @ v), or
    through scaled_dot_product_attention."""

    def __init__(self, sdpa=False):
        super().__init__()
        self.sdpa = sdpa
        self.query, self.key, self.value, self.out = (nn.Linear(HIDDEN, HIDDEN)
                                                      for _ in range(4))

    def heads(self, x):
        return x.view(BS, SEQ, HEADS, HIDDEN // HEADS).permute(0, 2, 1, 3)

    def forward(self, x):
        q, k, v = self.heads(self.query(x)), self.heads(self.key(x)), self.heads(self.value(x))
        if self.sdpa:
            ctx = F.scaled_dot_product_attention(q, k, v)
        else:
            scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(HIDDEN // HEADS)
            ctx = torch.matmul(F.softmax(scores, dim=-1), v)
        return self.out(ctx.permute(0, 2, 1, 3).contiguous().view(BS, SEQ, HIDDEN))


def test_the_reshard_costs_are_upstreams_shares_of_the_tensor():
    n, p = 4096, 8
    assert reshard_cost(RS, RR, n, p) == reshard_cost(SR, RR, n, p) == n // p  # all-gather
    assert reshard_cost(RS, SR, n, p) == n // p - n // p ** 2  # all-to-all
    assert reshard_cost(RR, RS, n, p) == reshard_cost(RR, SR, n, p) == 1  # a local split
    assert all(reshard_cost(a, a, n, p) == 0 for a in (RR, RS, SR))


def test_mlp_optimum_splits_the_sequence_and_gathers_the_output_once():
    """Every linear must split something. Split rows (SR x RR -> SR) through both linears
    costs splitting the input (1) and gathering the output (bs*seq*h/p); Megatron's
    column-then-row pair costs an all-reduce of the whole output, p times more."""
    p = 8
    with slapo.init_empty_weights():  # the meta-device path: shapes only
        gm = traced(MLP())
    results, cost = Solver(gm, p).solve([torch.randn(BS, SEQ, HIDDEN)])
    assert (results["fc1_0"], results["fc1_1"]) == (SR, RR)
    assert (results["fc2_0"], results["fc2_1"]) == (SR, RR)
    assert cost == BS * SEQ * HIDDEN // p + 1
    assert isinstance(cost, int)


def test_a_lone_linear_is_column_parallel_and_its_schedule_says_so():
    """One linear: column-parallel (RR x RS) then gathering its output costs out/p, one less
    than splitting the rows first; the schedule shards weight and bias along the output
    features and gathers after the module."""
    p = 4
    solver = Solver(traced(nn.Sequential(nn.Linear(HIDDEN, 2 * HIDDEN))), p)
    results, cost = solver.solve([torch.randn(BS, SEQ, HIDDEN)])
    assert (results["_0_0"], results["_0_1"]) == (RR, RS)
    assert cost == BS * SEQ * 2 * HIDDEN // p
    steps = [(s.primitive, s.target, s.kwargs) for s in solver.schedule()]
    assert steps == [("shard", "0", {"param_names": ["weight", "bias"], "axis": 0}),
                     ("sync", "0", {"mode": "fwd_post", "sync_op_or_fn": "RS->RR"})]
    assert [str(s) for s in solver.schedule()] == [
        "sch[\"0\"].shard(param_names=['weight', 'bias'], axis=0)",
        "sch[\"0\"].sync(mode='fwd_post', sync_op_or_fn='RS->RR')"]
    assert solver.layout("_0") == "RS"


@pytest.mark.parametrize("sdpa", [False, True], ids=["matmul-softmax-matmul", "sdpa"])
def test_attention_optimum_keeps_keys_and_values_whole(sdpa):
    """The query rows split (3 linears fed a split input: 3), keys and values gathered before
    attention (2 x bs*seq*h/p), the output linear row-split and its output gathered
    (bs*seq*h/p). Scaled dot-product attention costs what its decomposition costs."""
    p = 4
    x = BS * SEQ * HIDDEN // p
    solver = Solver(traced(Attention(sdpa)), p)
    results, cost = solver.solve([torch.randn(BS, SEQ, HIDDEN)])
    assert cost == 3 * x + 3
    assert all(results[f"{name}_1"] == RR for name in ("query", "key", "value", "out"))
    steps = {(s.primitive, s.target, s.kwargs["sync_op_or_fn"] if s.primitive == "sync"
              else s.kwargs["scheme"]) for s in solver.schedule()}
    assert {("sync", name, "RR->SR") for name in ("query", "key", "value")} <= steps
    assert ("sync", "out", "SR->RR") in steps


def test_a_transformers_bert_layer_traced_flat_costs_three_gathers_and_four_splits():
    """transformers 5's BertLayer (attention through SDPA, view + transpose, shape reads):
    as the hand-written attention, plus the residual add's split of the layer input."""
    from transformers import BertConfig
    from transformers.models.bert.modeling_bert import BertLayer

    config = BertConfig(hidden_size=HIDDEN, num_attention_heads=HEADS,
                        intermediate_size=4 * HIDDEN, attn_implementation="sdpa")
    with slapo.init_empty_weights():
        sch = slapo.create_schedule(BertLayer(config))
    sch.trace(recursive=False, flatten=True, tracer="pytorch",
              example_inputs={"hidden_states": torch.randn(BS, SEQ, HIDDEN)})
    p = 4
    _, cost = Solver(sch.mod, p).solve([torch.randn(BS, SEQ, HIDDEN)])
    assert cost == 3 * (BS * SEQ * HIDDEN // p) + 4



def test_a_transformers_gpt_neo_block_puts_where_operands_in_one_layout():
    """transformers 5's GPTNeoBlock (eager matmul-softmax-matmul attention, the causal mask
    applied by torch.where): ln_1's input split (1), keys and values gathered (2 x
    bs*seq*h/p), the causal mask split with the scores it selects from (1; the 0-d fill value
    meets any layout), the residual add's split of the input (1), the block's output gathered
    (bs*seq*h/p)."""
    from transformers import GPTNeoConfig
    from transformers.models.gpt_neo.modeling_gpt_neo import GPTNeoBlock

    config = GPTNeoConfig(hidden_size=HIDDEN, num_heads=HEADS, num_layers=1,
                          attention_types=[[["global"], 1]], max_position_embeddings=SEQ,
                          attn_implementation="eager")
    with slapo.init_empty_weights():
        sch = slapo.create_schedule(GPTNeoBlock(config, layer_id=0))
    sch.trace(flatten=True, example_inputs={"hidden_states": torch.randn(BS, SEQ, HIDDEN)})
    p = 4
    solver = Solver(sch.mod, p)
    results, cost = solver.solve([torch.randn(BS, SEQ, HIDDEN)])
    assert cost == 3 * (BS * SEQ * HIDDEN // p) + 3
    where = [name for name in results if name.startswith("where_")]
    assert len(where) == 2 and len({results[name] for name in where}) == 1

def test_an_op_without_a_rule_is_an_error_naming_the_node_and_its_target():
    class Cumulative(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(HIDDEN, HIDDEN)

        def forward(self, x):
            return torch.cumsum(self.fc(x), dim=-1)

    with pytest.raises(UnsupportedOpError, match=r"unsupported call function 'cumsum' \(cumsum\)"):
        Solver(traced(Cumulative()), 4).solve([torch.randn(BS, SEQ, HIDDEN)])
    assert issubclass(UnsupportedOpError, RuntimeError)  # upstream raised RuntimeError


def test_solving_leaves_the_module_as_it_was():
    gm = traced(MLP())
    before = {k: v.clone() for k, v in gm.state_dict().items()}
    code = gm.code
    Solver(gm, 2).solve([torch.randn(BS, SEQ, HIDDEN)])
    assert gm.code == code
    assert all(torch.equal(before[k], v) for k, v in gm.state_dict().items())
    assert all("tensor_meta" not in node.meta for node in gm.graph.nodes)


def test_bad_arguments_are_refused():
    with pytest.raises(TypeError, match="traced fx.GraphModule"):
        Solver(MLP(), 2)
    with pytest.raises(ValueError, match="p >= 2"):
        Solver(traced(MLP()), 1)
    with pytest.raises(RuntimeError, match=r"solve\(\) first"):
        Solver(traced(MLP()), 2).schedule()


def test_without_z3_solving_says_which_extra_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "z3", None)
    with pytest.raises(ImportError, match=r"slapo\[solver\]"):
        Solver(traced(MLP()), 2).solve([torch.randn(BS, SEQ, HIDDEN)])


def test_import_slapo_and_the_solver_class_load_no_z3():
    code = ("import sys, slapo; from slapo.sharding import Solver; "
            "print('z3' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "False"

