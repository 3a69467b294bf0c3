"""Peak memory of one training step of a BERT encoder, with or without checkpoint().

Run as a script in a fresh process: prints the growth of peak RSS over the RSS before the
step, in bytes (on CPU there is no allocator counter; RSS is what the OS gives).
"""

import resource
import sys

import torch
from transformers import BertConfig, BertModel

import slapo

LAYERS = 8


def main(mode: str) -> None:
    torch.set_num_threads(1)
    config = BertConfig(vocab_size=512, hidden_size=256, num_hidden_layers=LAYERS,
                        num_attention_heads=4, intermediate_size=1024,
                        max_position_embeddings=512)
    torch.manual_seed(0)
    model = BertModel(config).train()
    if mode == "checkpoint":
        sch = slapo.create_schedule(model)
        for i in range(LAYERS):
            sch[f"encoder.layer.{i}"].checkpoint()
        model = slapo.build(sch)
    ids = torch.randint(0, config.vocab_size, (4, 512))
    before = int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize()
    model(input_ids=ids).last_hidden_state.pow(2).mean().backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(peak - before)


if __name__ == "__main__":
    main(sys.argv[1])
