"""Layer-streamed forward passes of an HF checkpoint: logits at any model size in the memory of one decoder layer.

transformers' own model class does the arithmetic; only where the weights live changes. The model is built empty
(accelerate's `init_empty_weights`: parameters on the meta device, buffers such as RoPE frequencies computed as
usual), the weights outside the decoder layers (embeddings, final norm, head) are read from the safetensors files,
and each decoder layer reads its weights when the model's forward reaches it and drops them when it leaves. One
forward of the base model carries a group of windows, so every layer is read once per group, and inside a layer the
windows go through one at a time: the same shapes, kernels and order of operations as a whole-model pass of one
window, hence the same logits to the last bit on CPU (tests/test_layer_stream.py compares them).

A compressed-tensors checkpoint (llm-compressor's output) is set up as transformers' quantizer sets it up, and each
layer's compressed weights are decompressed by compressed-tensors as they are read, as the whole model's first
forward pass decompresses them all.

Peak memory: the non-layer weights, one layer's weights (in the compute dtype, plus its stored copy while it is
cast), the group's hidden states and one window's activations, independent of the number of layers. Checkpoints
whose weights transformers renames or fuses while loading (MoE experts) or that another quantizer loads
(bitsandbytes, GPTQ, AWQ) are not streamable: `NotStreamable` says why and the caller loads the whole model.
"""

from __future__ import annotations

import copy
import gc
import json
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

GROUP_HIDDEN_BYTES = 256 << 20    # hidden states of one group of windows (a layer holds its input and output)


class NotStreamable(Exception):
    """This checkpoint cannot be read one layer at a time by name (the message says why)."""


def checkpoint_index(path: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file that holds it, from the shard index or the single file's header."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return {name: path / f for name, f in json.loads(index.read_text())["weight_map"].items()}
    single = path / "model.safetensors"
    if not single.is_file():
        raise NotStreamable(f"{path.name} has no safetensors weights")
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


def read_headers(path: Path) -> None:
    """Read every safetensors file's header: a truncated or corrupt file raises safetensors' own error."""
    from safetensors import safe_open

    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            f.keys()


def checkpoint_bytes(path: Path) -> int:
    """Bytes of the checkpoint's weight files."""
    return sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))


def _decoder_layers(model) -> tuple[str, object]:
    """The ModuleList that holds the most parameters: the decoder layers (model.layers, transformer.h, ...)."""
    import torch

    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m)]
    if not lists:
        raise NotStreamable("no list of decoder layers in the model")
    return max(lists, key=lambda nm: sum(p.numel() for p in nm[1].parameters()))


def _read(tensors: dict[str, str], index: dict[str, Path]) -> Iterator[tuple[str, object]]:
    """(parameter name, stored tensor) for `tensors` (parameter name -> checkpoint name), one file open at a time: a
    file is mapped only while its tensors are copied out, so resident pages stay those of the tensors read."""
    from safetensors import safe_open

    by_file = defaultdict(list)
    for param, stored in tensors.items():
        by_file[index[stored]].append((param, stored))
    for file, names in by_file.items():
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for param, stored in names:
                yield param, f.get_tensor(stored)


def _slice_batch(x, i: int, batch: int):
    """Window i of a layer argument that carries the batch on its first axis (hidden states, masks, per-window
    position tensors); tuples (RoPE cos/sin) element-wise; anything else as it is."""
    import torch

    if isinstance(x, tuple):
        return tuple(_slice_batch(v, i, batch) for v in x)
    if isinstance(x, torch.Tensor) and x.dim() > 1 and x.shape[0] == batch:
        return x[i: i + 1]
    return x


class LayerStreamedModel:
    """An HF causal LM whose decoder layers are read from the checkpoint one at a time, during the forward pass."""

    def __init__(self, path: Path, device: str, dtype):
        import torch
        from accelerate import init_empty_weights
        from accelerate.utils import set_module_tensor_to_device
        from transformers import AutoConfig, AutoModelForCausalLM

        self.torch, self.device, self.dtype = torch, device, dtype
        self.config = AutoConfig.from_pretrained(str(path))
        self.index = checkpoint_index(Path(path))
        with init_empty_weights():   # parameters on meta; buffers (RoPE inv_freq) real
            self.model = AutoModelForCausalLM.from_config(self.config, dtype=dtype).eval()
            self.decompress = self._quantized_modules()
        self.model.tie_weights()     # a tied head is the embedding, read once (from_pretrained ties it the same way)
        layers_name, self.layers = _decoder_layers(self.model)
        self.base = self.model.get_submodule(self.model.base_model_prefix)
        params = dict(self.model.named_parameters())     # tied weights once, under their first name
        missing = [n for n in params if n not in self.index]
        if missing:   # renamed or fused on load (MoE experts), or a different prefix: only transformers maps them
            raise NotStreamable(f"{len(missing)} parameter(s) are not stored under their own names ({missing[0]}, ...)")
        if any(b.is_meta for b in self.model.buffers()):
            raise NotStreamable("the model has buffers that are only loaded from the checkpoint")
        self._set = set_module_tensor_to_device
        outside = {n: n for n in params if not n.startswith(layers_name + ".")}
        self._load(self.model, outside)
        self.model.tie_weights()     # loading put a new embedding in place: the tied head follows it
        unread = [n for n, p in self.model.named_parameters(remove_duplicate=False)
                  if p.is_meta and not n.startswith(layers_name + ".")]
        if unread:
            raise NotStreamable(f"{unread[0]} is tied in a way this reader does not follow")
        in_layers = {id(m) for m in self.layers.modules()}
        self.decompress(m for m in self.model.modules() if id(m) not in in_layers)
        # each pass gets a fresh copy of the layer's empty skeleton: decompressing a quantized layer rebuilds its
        # parameters, so the skeleton itself is never filled
        self.skeletons = [copy.deepcopy(layer) for layer in self.layers]
        self.layer_tensors = [{n: f"{layers_name}.{i}.{n}" for n, _ in layer.named_parameters()}
                              for i, layer in enumerate(self.layers)]
        for i, layer in enumerate(self.layers):
            layer.forward = self._streamed(i)

    def _quantized_modules(self):
        """For a compressed-tensors checkpoint: set the empty model up as transformers' quantizer does when it loads
        one (compressed parameters under their stored names), and return what decompresses a loaded module the way
        the whole model's first forward pass does. For an unquantized one, a no-op. Other quantizers: NotStreamable."""
        qc = getattr(self.config, "quantization_config", None)
        self.quantized = qc is not None
        if qc is None:
            return lambda modules: None
        method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
        if str(getattr(method, "value", method)) != "compressed-tensors":
            raise NotStreamable(f"a {method} checkpoint is loaded by its own quantizer")
        from compressed_tensors.compressors.base import decompress_module
        from transformers.quantizers.auto import get_hf_quantizer

        quantizer, _, _ = get_hf_quantizer(self.config, None, None, True, {})
        quantizer.preprocess_model(model=self.model, dtype=self.dtype, device_map=None,
                                   checkpoint_files=sorted({str(f) for f in self.index.values()}), use_kernels=False)
        hook = getattr(self.model, "ct_decompress_hook", None)
        if hook is not None:   # it would decompress the whole (empty) model on the first forward pass
            hook.remove()

        def decompress(modules):
            for module in modules:
                decompress_module(module)
        return decompress

    def _load(self, module, tensors: dict[str, str]) -> None:
        """Read `tensors` (parameter name -> stored name) into `module`, each in the dtype its skeleton declares
        (the compute dtype for floats, the stored integer types of packed weights)."""
        declared = dict(module.named_parameters())
        for name, tensor in _read(tensors, self.index):
            if tensor.shape == declared[name].shape:
                self._set(module, name, self.device, value=tensor.to(declared[name].dtype))
            else:   # stored packed, as stored (an asymmetric scheme's int4 zero points): the decompressor unpacks it,
                owner, _, leaf = name.rpartition(".")   # as it does when transformers loads the model
                module.get_submodule(owner)._parameters[leaf] = self.torch.nn.Parameter(tensor.to(self.device),
                                                                                         requires_grad=False)
            del tensor

    def _streamed(self, i: int):
        def run(hidden_states, *args, **kwargs):
            live = copy.deepcopy(self.skeletons[i])
            self._load(live, self.layer_tensors[i])
            self.decompress(live.modules())
            batch = hidden_states.shape[0]
            outs = []
            for w in range(batch):
                outs.append(live(_slice_batch(hidden_states, w, batch), *(_slice_batch(a, w, batch) for a in args),
                                 **{k: v if k == "cache_position" else _slice_batch(v, w, batch)
                                    for k, v in kwargs.items()}))
            del live
            if self.quantized:   # compressed-tensors' forward wrappers bind the module to itself: only the cycle
                gc.collect()     # collector frees the layer's decompressed weights, and it runs by count, not size
            if isinstance(outs[0], tuple):   # transformers 4.x layers return (hidden_states, ...)
                return (self.torch.cat([o[0] for o in outs]), *outs[0][1:])
            return self.torch.cat(outs)
        return run

    def window_logits(self, windows, on_group=None) -> Iterator:
        """Logits of each window (a list of token ids), in order. Windows of equal length share a group up to
        GROUP_HIDDEN_BYTES of hidden states; each group reads every layer once."""
        torch = self.torch
        per_window = max(1, len(windows[0]) if windows else 1) * self.config.get_text_config().hidden_size * 4
        limit = max(1, GROUP_HIDDEN_BYTES // per_window)
        i = 0
        while i < len(windows):
            n = len(windows[i])
            group = [windows[i]]
            while len(group) < limit and i + len(group) < len(windows) and len(windows[i + len(group)]) == n:
                group.append(windows[i + len(group)])
            with torch.inference_mode():
                hidden = self.base(input_ids=torch.tensor(group, device=self.device), use_cache=False).last_hidden_state
                for row in range(len(group)):
                    yield self._head(hidden[row: row + 1], group[row])
            del hidden
            i += len(group)
            if on_group is not None:
                on_group(i, len(windows))

    def _head(self, hidden, tokens):
        """The model's own head on one window's final hidden states (softcapping and all): its forward with the
        base model standing in as these hidden states."""
        from transformers.modeling_outputs import BaseModelOutputWithPast

        prefix, base = self.model.base_model_prefix, self.base

        class Computed(self.torch.nn.Module):
            def forward(self, *args, **kwargs):
                return BaseModelOutputWithPast(last_hidden_state=hidden)

        setattr(self.model, prefix, Computed())
        try:
            ids = self.torch.tensor([tokens], device=self.device)
            return self.model(input_ids=ids, use_cache=False).logits[0].float().cpu().numpy()
        finally:
            setattr(self.model, prefix, base)
