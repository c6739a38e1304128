"""The text tracker decoding only the new ids (concatenative decoders) against decoding the whole text every
step: SmolLM2 int4 plain greedy decoding through SpecDecoder.generate (the CLI's and the library's path), the two
alternated round by round, the fastest of ROUNDS kept per length; also the tracker alone per token."""
import sys, time
from specdecode.generator import SpecDecoder, TextTracker

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 3
dec = SpecDecoder.from_pretrained("smollm2-135m", draft=None, threads=2, progress=False)
ids = dec.encode("Write a long story about a robot who learns to paint.", chat=True)
dec.generate(ids, max_new_tokens=32, ignore_eos=True)
cls = type(dec)
for n in (256, 1024, 2048):
    best = {True: 1e9, False: 1e9}
    texts = {}
    for r in range(ROUNDS):
        for conc in (False, True):
            cls.decode_is_concatenative = conc
            t = time.perf_counter(); out = dec.generate(ids, max_new_tokens=n, ignore_eos=True)
            best[conc] = min(best[conc], time.perf_counter() - t); texts[conc] = out.text
    assert texts[True] == texts[False]
    print(f"{n} tokens: whole decode {n / best[False]:.1f} tok/s, new ids only {n / best[True]:.1f} tok/s, "
          f"ratio {best[False] / best[True]:.3f}x, same text: yes")
    toks = out.token_ids
    for conc in (False, True):
        tr = TextTracker(dec.decode, ["\n\n\n\n"], concatenative=conc)
        t = time.perf_counter()
        for i in range(n): tr.add(toks[i:i + 1])
        print(f"   tracker alone, one token a step, concatenative={conc}: {(time.perf_counter() - t) / n * 1e3:.4f} ms/token")
