"""Issue 24's evidence: BNP on two small Transformers whose every projection it transforms (RESULTS.md §7).

``python -m benchmarks.transformers [--device cuda] [--jobs 10]`` trains

* a ViT (:class:`example_projects.transformers.ViT`: 7×7 patches, d = 64, 2 blocks, 4 heads) on the 28×28
  MNIST digits at batch 6 and 60 with LayerNorm, with no normalization, no normalization + BNP and
  LayerNorm + BNP (plain SGD);
* a causal byte-level LM (:class:`example_projects.transformers.CharLM`: d = 128, 2 blocks, context 64,
  batch 32, LayerNorm) on the first 2 MB of the installed torch package's ``.py`` sources (90% train,
  5% validation, 5% test) with SGD, SGD + BNP, Adam and Adam + BNP;

each variant over a learning-rate grid and several seeds in parallel worker processes, chooses every
variant's rate on the validation split, times the variants side by side in one process, and writes §7 of
``<out>/RESULTS.md`` (replaced, or inserted before the closing run summary) and ``<out>/results/transformers.png``.
"""
