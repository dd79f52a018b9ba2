"""The mutants of ``--attention-cuda-graph`` (``fairseq_linattn/modules/cuda_graph.py`` and how the attention
modules call it); ``dev.mutants`` lists them with the others."""
from .mutant import MOD, Mutant

M = Mutant
GRAPH_T = ("tests/plugin/test_cuda_graph.py",)
GRAPH_MUTANTS = [
    M("graph-warmup-folds-kept", MOD + "cuda_graph.py", "                buffer.copy_(before)", "                pass",
      "the capture's warm-up passes fold three more batches into the matcher's running statistics", GRAPH_T),
    M("graph-key-ignores-switches", MOD + "cuda_graph.py",
      "key = (x.shape, x.dtype, x.device, x.requires_grad, mask_shape, _FLAGS.statistics_left_out,",
      "key = (x.shape, x.dtype, x.device, x.requires_grad, mask_shape, False,",
      "a dummy batch's step replays the graph that adds its statistics", GRAPH_T),
    M("graph-second-forward-replays", MOD + "cuda_graph.py", "            self.pending_backward = True\n", "",
      "a second forward before the first's backward overwrites the activations that backward reads", GRAPH_T),
    M("graph-grads-aliased", MOD + "cuda_graph.py", "                param.register_hook(_copied)",
      "                pass", "the parameters' .grad are the graph's static tensors, overwritten by the next "
      "replay (gradient accumulation loses all but the last step)", GRAPH_T),
    M("graph-shapes-unbounded", MOD + "cuda_graph.py", "if len(self.graphs) >= MAX_SHAPES:",
      "if len(self.graphs) > MAX_SHAPES:", "a module captures one more shape than its bound", GRAPH_T),
    M("graph-kept-after-cast", MOD + "base.py", 'self.__dict__.pop("_cuda_graphs", None)', "None",
      "a cast or moved module replays graphs that read its old tensors", GRAPH_T),
    M("graph-refused-nowhere", "fairseq_linattn/options.py", 'if device != "cuda":', "if False:",
      "--attention-cuda-graph accepted on the CPU, to fail at the first step", GRAPH_T),
    M("graph-copy-shares-graphs", MOD + "base.py", '        state.pop("_cuda_graphs", None)', "        pass",
      "a deep copy replays the original's graphs, which read the original's tensors", GRAPH_T),
    M("graph-copy-grads-aliased", MOD + "cuda_graph.py", "_COPIED.get(id(param)) is not param:", "not _COPIED:",
      "a second module's (a deep copy's) parameters' gradients left as its graph's static tensors", GRAPH_T),
    M("graph-capture-global", MOD + "cuda_graph.py", 'CAPTURE_MODE = "thread_local"', 'CAPTURE_MODE = "global"',
      "a capture mid-epoch broken by the DataLoader's pin-memory thread", GRAPH_T),
    M("graph-mode-left-patched", MOD + "cuda_graph.py", "        torch.cuda.graph = opened\n", "",
      "torch.cuda.graph left in thread-local mode for the rest of the process", GRAPH_T),
    M("graph-train-forgets-nothing", MOD + "base.py", "            steps.forget_pending()", "            pass",
      "a step whose backward never came holds every later step eager", GRAPH_T),
]
