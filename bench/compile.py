"""torch.compile over a patched model beside the unpatched model, side by side in one run, on the same rows:
compile time (the first step), graphs and graph breaks (torch's counting backend over AOT autograd), and the
mean step time of the steps after the first, against eager. Every step has its own packed boundaries (and
sequence count), as training steps do; the unpatched model runs the same rows as a padded batch. Compiled per
decoder layer (``layer.compile()``), whole (``model.compile()``) and whole with ``fullgraph=True``.

    python bench/compile.py [--family qwen2] [--layers 28] [--steps 8]
"""

import argparse
import time

import torch


def _rows(step):
    g = torch.Generator().manual_seed(step)
    count = int(torch.randint(1, 5, (1,), generator=g))
    return [torch.randint(5, 60, (int(n),), generator=g).tolist() for n in torch.randint(8, 33, (count,), generator=g)]


def run(name, layers, steps, patched, how):
    """(compile seconds, graphs, breaks, mean step ms after the first) of one configuration."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    import tfcompat
    from tfcompat.packing import pack
    from tfcompat.testing import padded_batch, tiny_model

    torch._dynamo.reset()
    counters.clear()
    model = tiny_model(name, num_hidden_layers=layers)
    model.train()
    if patched:
        tfcompat.patch(model)
    counter = CompileCounterWithBackend("aot_eager")
    if how == "per layer":
        text = next(m for m in model.modules() if "layers" in m._modules and "embed_tokens" in m._modules)
        for layer in text.layers:
            layer.compile(backend=counter)
    elif how == "whole":
        model.compile(backend=counter)
    elif how == "fullgraph":
        model = torch.compile(model, backend=counter, fullgraph=True)
    times = []
    for step in range(steps):
        ids, mask = padded_batch(_rows(step))
        start = time.perf_counter()
        if patched:
            pk = pack(ids, mask)
            out = model(input_ids=pk.input_ids, position_ids=pk.position_ids, use_cache=False).logits
        else:
            out = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        out.float().sum().backward()
        times.append(time.perf_counter() - start)
    breaks = sum(counters["graph_break"].values())
    return times[0], counter.frame_count, breaks, 1e3 * sum(times[1:]) / max(1, len(times) - 1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="qwen2")
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    import transformers

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {args.family}, {args.layers} "
          f"layers, {args.steps} steps of different boundaries, one thread")
    print(f"{'compile':<10} {'model':<10} {'first step s':>12} {'graphs':>7} {'breaks':>7} {'step ms':>9} "
          f"{'vs eager':>9}")
    eager = {}
    for how in ("eager", "per layer", "whole", "fullgraph"):
        for patched in (False, True):
            try:
                first, graphs, breaks, ms = run(args.family, args.layers, args.steps, patched, how)
            except Exception as exc:  # a configuration that does not compile is a row of the table, not the end
                print(f"{how:<10} {'patched' if patched else 'unpatched':<10} fails: {type(exc).__name__}: "
                      f"{str(exc).splitlines()[0][:80]}")
                continue
            eager.setdefault(patched, ms)  # the eager row of the same model comes first
            print(f"{how:<10} {'patched' if patched else 'unpatched':<10} {first:>12.2f} {graphs:>7} {breaks:>7} "
                  f"{ms:>9.1f} {ms / eager[patched]:>8.2f}x")

if __name__ == "__main__":
    main()
