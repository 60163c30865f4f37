"""A GGUF file's tokenizer written as Hugging Face files that tokenize as llama.cpp does on that file.

transformers' GGUF loader picks its tokenizer converter by model architecture, not by the vocabulary's type: a
Gemma-2 GGUF's SentencePiece vocabulary becomes a Unigram model that splits text into single characters, a Llama
one gets BOS as its EOS, and neither gets the `tokenizer.model` llama.cpp's converter needs (without it,
convert_hf_to_gguf.py falls back to its BPE path and stops: "BPE pre-tokenizer was not recognized"). So the
tokenizer is rebuilt here from `tokenizer.ggml.*`, by vocabulary type, as a `tokenizers` pipeline configured to be
llama.cpp's (src/llama-vocab.cpp) on that type:

- `llama` (SentencePiece): llama.cpp escapes spaces as ▁, puts one ▁ before the text (and after each special token)
  when the vocabulary has a space prefix, and merges the pair whose merged piece scores highest over the whole text
  (no split at spaces). Here: a normalizer that prepends ▁ and replaces spaces, no pre-tokenizer, a BPE model whose
  merges are ranked by the merged piece's score, with byte fallback. Also a real `tokenizer.model` (sentencepiece's
  ModelProto: the GGUF's pieces, scores and types), for llama.cpp's converter and sentencepiece readers.
  (transformers' own SentencePiece conversion ranks merges by token id and puts its Metaspace ▁ only where the text
  does not start with one: `'  We'` became `['▁▁', 'We']`, llama.cpp's `['▁', '▁We']`.)
- `gpt2` (byte-level BPE): the GGUF's tokens and merges, split first as llama.cpp splits for the GGUF's
  `tokenizer.ggml.pre` (BPE_PRE: its regexes, each applied in turn to the pieces of the one before, as llama.cpp's
  unicode_regex_split does), with llama.cpp's ignore_merges;
- `gemma4` (SentencePiece-style BPE on UTF-8): spaces as ▁, the text split at newlines, the GGUF's merges, byte
  fallback.

with the special tokens (bos/eos/unk/pad and the control tokens), add_bos/add_eos and the chat template. A
vocabulary whose type or pre-tokenizer is not one of these is refused in one line (TokenizerRefused): llama.cpp would
split its text in a way the import could not reproduce. tests/test_gguf_vocab_vectors.py holds every vocabulary
llama.cpp ships a test file for to llama.cpp's own expected tokens.
"""

from __future__ import annotations

import json
import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path

# GGUF token types (gguf.TokenType) — the same numbers as sentencepiece's ModelProto.SentencePiece.Type
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


class TokenizerRefused(ValueError):
    """A GGUF vocabulary the import cannot tokenize as llama.cpp does: the message says why (one line)."""


_GPT2_REGEX = None   # ByteLevel's own (use_regex=True) is GPT-2's
_DIGIT = "digit"     # each digit apart (pre_tokenizers.Digits(individual_digits=True), llama.cpp's "\p{N}" first)
_LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                 r"\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
# llama-vocab.cpp's regexes (llm_tokenizer_bpe's regex_exprs), verbatim but for non-ASCII characters written as
# escapes (an editor that normalizes Unicode would move a range's ends: NFC turns U+1F7D into U+03CE)
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|"
           r"\s+")
_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_HAN_KANA = "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"
_DEEPSEEK_LLM_LETTERS = (
    "\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373\u0376\u0377"
    "\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556"
    "\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a"
    "\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4"
    "\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc"
    "\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f"
    "\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b"
    "\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a"
    "\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2"
    "\U000118a0-\U000118df\U0001e900-\U0001e943")
_PUNCT_WORD = r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
_DEEPSEEK3 = (r"\p{N}{1,3}", _HAN_KANA, _PUNCT_WORD + r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_BLOOM = " ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"
_CASED = (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+<c>|"
          r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*<c>")
_GPT4O = (_CASED.replace("<c>", _CONTRACTIONS + "?") + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|"
          r"\s+(?!\S)|\s+")
_TEKKEN = _CASED.replace("<c>", "") + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
# llama.cpp runs a regex with \p{...} on text whose every letter is one class: its \p{Lu} (\p{Ll}, ...) is \p{L},
# and "[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+" (or the other way round) is this
_LETTERS = r"[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+" + _CONTRACTIONS + "?"
_AYA = _LETTERS + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_YOUTU = (
    "[\uac00-\ud7a3\u3131-\u318e]+|[\uff01\u2026\u201c\u201d\u2018\u2019\u2014\uff1a\uff1b\uff0c\u3001-\u303f"
    "\ufe30-\ufe4f]+|[\u3105-\u312f]+|" + _HAN_KANA,
    _LETTERS + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# (std::regex's \d and \b are ASCII's)
_ASCII_B = r"(?:(?<=[A-Za-z0-9_])(?![A-Za-z0-9_])|(?<![A-Za-z0-9_])(?=[A-Za-z0-9_]))"


@dataclass(frozen=True)
class Pre:
    """How llama.cpp (llama-vocab.cpp) splits text before BPE for one `tokenizer.ggml.pre`."""

    split: tuple            # regexes applied in turn (_GPT2_REGEX: ByteLevel's own, _DIGIT: each digit apart)
    ignore_merges: bool = False     # a piece that is a token is that token (llama.cpp's ignore_merges)
    add_bos: bool = False           # llama.cpp's add_bos where the GGUF does not say


def _pres(names: str, pre: Pre) -> dict[str, Pre]:
    return dict.fromkeys(names.split(), pre)


# tokenizer.ggml.pre → llama.cpp's split (None: the GGUF names none, llama.cpp's "default"). Each is held to llama.cpp
# by tests/test_gguf_vocab_vectors.py (a vocabulary renamed to each pre-tokenizer, tokenized by both).
_DEFAULT = Pre((r"[\p{P}\$\+<=>\^~\|]+", _GPT2_SPLIT, r"\p{N}+", "[0-9][0-9][0-9]"))
BPE_PRE: dict[str | None, Pre] = {
    **_pres("gpt-2 phi-2 mpt olmo jais roberta-bpe exaone4 trillion gigachat a.x-4.0 mellum granite-docling",
            Pre((_GPT2_REGEX,))),
    **_pres("smollm starcoder refact command-r codeshell exaone minerva-7b mellum2", Pre((_DIGIT, _GPT2_REGEX))),
    **_pres("llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2",
            Pre((_LLAMA3_REGEX,), ignore_merges=True, add_bos=True)),
    **_pres("dbrx smaug-bpe chatglm-bpe", Pre((_LLAMA3_REGEX,))),
    **_pres("glm4 glm5", Pre((_LLAMA3_REGEX,), ignore_merges=True)),
    **_pres("qwen2 deepseek-r1-qwen stablelm2 megrez kormo f2llmv2 hunyuan solar-open grok-2", Pre((_QWEN2_REGEX,))),
    "qwen35": Pre((_QWEN35,)),
    None: _DEFAULT,
    "default": _DEFAULT,
    "falcon": Pre((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2_SPLIT, "[0-9][0-9][0-9]")),
    "deepseek-llm": Pre(("[\r\n]", r"\s?[A-Za-z" + _DEEPSEEK_LLM_LETTERS + "]+",
                         r"\s?[!-/:-~" "\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+", r"\s+$", _CJK,
                         r"\p{N}+")),
    "deepseek-coder": Pre(("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}")),
    **_pres("deepseek-v3 hunyuan-dense joyai-llm hy_v4", Pre(_DEEPSEEK3)),
    "spark2_5": Pre((r"\p{N}{1,3}", _HAN_KANA, _PUNCT_WORD + r"| ?[\p{P}\p{S}]+|[\r\n]|\s+(?!\S)|\s+", r"\p{N}")),
    "youtu": Pre(_YOUTU, ignore_merges=True),
    "jais-2": Pre((_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
                   + "|".join(rf"\s{{{n}}}(?!\S)" for n in (512, 256, 128, 64, 32, 16, 8, 4)) + r"|\s{1,2}(?!\S)|\s{1}",)),
    **_pres("poro-chat bloom gpt3-finnish", Pre((_BLOOM,))),
    "viking": Pre((_BLOOM, r"\p{N}")),
    "tekken": Pre((_TEKKEN,), ignore_merges=True, add_bos=True),
    "chameleon": Pre((r"<sentinel:[0-9]+>", r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z", r"([\t\n]|    |  )", r"\p{N}",
                      r"[\p{P}!-/:-@\[-`{-~]", _GPT2_SPLIT), add_bos=True),
    **_pres("gpt-4o llama4 kanana2 talkie minimax-m2", Pre((_GPT4O,))),
    **_pres("tiny_aya cohere2moe", Pre((r"[0-9]{1,3}(?=(?:[0-9]{3})*" + _ASCII_B + ")", _AYA))),
    "superbpe": Pre((r"\p{N}+", r"(?=([0-9]{3})+(?![0-9]))")),
    **_pres("bailingmoe bailingmoe2 llada-moe",
            Pre((r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                 r"\s*[\r\n]|\s+(?!\S)|\s+",))),
    "seed-coder": Pre((_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|"
                       r"\s+(?!\S)|\s+",)),
    "ufakzeka": Pre((r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",)),
    "laguna": Pre((r"[^\n]+|[\n]+", _QWEN2_REGEX)),
    "exaone-moe": Pre((_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}|"
                       r" ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+",)),
    "minicpm5": Pre((r"\p{N}{1,3}", _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                     r"\s*[\r\n]+|\s+(?!\S)|\s+"), ignore_merges=True),
}
# model types other than `llama`/`gpt2` with the reason they are refused; others: "not one qbuild rebuilds"
REFUSED_MODELS = {
    "bert": "a WordPiece vocabulary (BERT-style encoders): not a causal language model qbuild imports",
    "t5": "a Unigram vocabulary (llama.cpp's UGM tokenizer, T5-style): qbuild does not rebuild it",
}


def llama_cpp_adds_bos(model: str, pre: str | None) -> bool:
    """Whether llama.cpp starts a sequence with BOS for a GGUF that does not say (llama-vocab.cpp's default by
    vocabulary): SentencePiece and Gemma 4 do, BPE vocabularies where their pre-tokenizer says so (Llama 3's)."""
    return model in ("llama", "gemma4") or (model == "gpt2" and pre in BPE_PRE and BPE_PRE[pre].add_bos)


@dataclass
class GGUFVocab:
    """A GGUF's `tokenizer.*` metadata."""

    model: str                          # tokenizer.ggml.model: llama (SentencePiece), gpt2 (byte-level BPE), ...
    pre: str | None
    tokens: list[str]
    types: list[int]
    scores: list[float] | None
    merges: list[str] | None
    special: dict[str, int] = field(default_factory=dict)    # bos/eos/unk/pad → id
    add_bos: bool = False                # as llama.cpp reads the GGUF (its default where the GGUF says nothing)
    add_eos: bool = False
    add_space_prefix: bool | None = None
    chat_template: str | None = None
    architecture: str = ""
    name: str = ""                       # general.name: llama.cpp sets some token attributes by it (Phi-3)

    def token(self, kind: str) -> str | None:
        i = self.special.get(kind)
        return self.tokens[i] if i is not None and 0 <= i < len(self.tokens) else None


def read_vocab(path: Path) -> GGUFVocab:
    fields = read_metadata(path, lambda key: key.startswith("tokenizer.") or key in ("general.architecture",
                                                                                       "general.name"))
    value = fields.get
    special = {kind: int(v) for kind, key in (("bos", "bos_token_id"), ("eos", "eos_token_id"),
                                              ("unk", "unknown_token_id"), ("pad", "padding_token_id"))
               if (v := value(f"tokenizer.ggml.{key}")) is not None}
    tokens = value("tokenizer.ggml.tokens")
    if not tokens:
        raise ValueError(f"{path.name} has no tokenizer.ggml.tokens: no vocabulary to import")
    types = value("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    model, pre = value("tokenizer.ggml.model") or "", value("tokenizer.ggml.pre")
    add_bos, add_eos = value("tokenizer.ggml.add_bos_token"), value("tokenizer.ggml.add_eos_token")
    # where the GGUF does not say, what llama.cpp does; Gemma 4: llama.cpp adds BOS even where the GGUF says not to
    add_bos = llama_cpp_adds_bos(model, pre) if add_bos is None or model == "gemma4" else bool(add_bos)
    return GGUFVocab(model=model, pre=pre, tokens=list(tokens),
                     types=[int(t) for t in types], scores=value("tokenizer.ggml.scores"),
                     merges=value("tokenizer.ggml.merges"), special=special,
                     add_bos=add_bos, add_eos=False if add_eos is None else bool(add_eos),
                     add_space_prefix=value("tokenizer.ggml.add_space_prefix"),
                     chat_template=value("tokenizer.chat_template"),
                     architecture=value("general.architecture") or "", name=value("general.name") or "")


# GGUF metadata value types: fixed-size scalars (struct code), STRING = 8, ARRAY = 9
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


def read_metadata(path: Path, wanted=lambda key: True) -> dict:
    """The GGUF's metadata values whose key `wanted` accepts (numbers, strings, lists of them), read straight from
    the file: gguf-py's reader builds a numpy view per array element, 21 s for a 256k-token vocabulary; this reads
    it in a fraction of a second. Every length is checked against the bytes there; raises ValueError in one line."""
    import numpy as np

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        size = len(data)
        pos = 0

        def take(n: int) -> int:
            nonlocal pos
            if n < 0 or pos + n > size:
                raise ValueError(f"{path.name}: metadata runs past the end of the file (byte {pos} + {n} of {size})")
            start, pos = pos, pos + n
            return start

        if size < 24 or data[:4] != b"GGUF":
            raise ValueError(f"{path.name} is not a GGUF file")
        order = "<"
        version = struct.unpack_from("<I", data, 4)[0]
        if version & 0xFFFF == 0:       # a big-endian file
            order, version = ">", struct.unpack_from(">I", data, 4)[0]
        if version not in (2, 3):
            raise ValueError(f"{path.name}: GGUF version {version} (qbuild reads 2 and 3)")
        take(8)
        _tensors, count = struct.unpack_from(order + "QQ", data, take(16))

        def unpack(code: str):
            return struct.unpack_from(order + code, data, take(struct.calcsize(code)))[0]

        def string() -> str:
            n = unpack("Q")
            start = take(n)
            return data[start:start + n].decode("utf-8")

        def value(kind: int, keep: bool, depth: int = 0):
            if kind in _SCALARS:
                return unpack(_SCALARS[kind])
            if kind == _STRING:
                return string()
            if kind != _ARRAY or depth > 1:
                raise ValueError(f"{path.name}: metadata value type {kind} is not one GGUF has")
            sub, n = unpack("I"), unpack("Q")
            if sub in _SCALARS:
                width = struct.calcsize(_SCALARS[sub])
                start = take(n * width)
                if not keep:
                    return None
                dtype = np.dtype(bool) if sub == 7 else np.dtype(order + _SCALARS[sub])
                return np.frombuffer(data, dtype=dtype, count=n, offset=start).tolist()
            if n > size - pos:
                raise ValueError(f"{path.name}: an array of {n} entries in {size - pos} bytes")
            if sub == _STRING:     # a vocabulary's tokens and merges: the loop inlined (0.5 s for 500k strings)
                items, at, length = [], pos, struct.Struct(order + "Q")
                for _ in range(n):
                    if at + 8 > size:
                        take(at + 8 - pos)          # raises, naming where
                    (k,) = length.unpack_from(data, at)
                    if k > size - at - 8:
                        take(at + 8 + k - pos)
                    items.append(data[at + 8:at + 8 + k].decode("utf-8"))
                    at += 8 + k
                take(at - pos)
                return items if keep else None
            return [value(sub, keep, depth + 1) for _ in range(n)]

        out = {}
        for _ in range(count):
            key = string()
            keep = wanted(key)
            v = value(unpack("I"), keep)
            if keep:
                out[key] = v
        return out


# the byte-level BPE pre-tokenizers whose written files are what they were before issue 47 (all but dbrx/smaug-bpe,
# which lost Llama 3's ignore_merges and BOS)
_UNCHANGED_PRE = frozenset({
    "gpt-2", "phi-2", "mpt", "olmo", "jais", "roberta-bpe", "exaone4", "trillion", "smollm", "starcoder", "refact",
    "command-r", "codeshell", "exaone", "minerva-7b", "llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "qwen2",
    "deepseek-r1-qwen", "stablelm2", "megrez"})


def writer_version(model: str, pre: str | None, name: str = "") -> int | None:
    """The version of what write_tokenizer writes for a GGUF of this tokenizer.ggml.model / .pre / general.name, for
    the import step's key: None where the files are byte for byte what they were before issue 47 (byte-level BPE
    with a pre-tokenizer qbuild knew then, SmolLM2's demo GGUF among them), so those keys stay; 2 where they changed
    (SentencePiece and Gemma 4 vocabularies, the pre-tokenizers added then or corrected, Phi-3-named files)."""
    lowered = name.lower()
    if model == "gpt2" and pre in _UNCHANGED_PRE and "phi-3" not in lowered and "phi3" not in lowered:
        return None
    return 2


def refusal(vocab: GGUFVocab) -> str | None:
    """Why qbuild cannot tokenize this vocabulary as llama.cpp does (one line), or None."""
    return vocabulary_refusal(vocab.model, vocab.pre)


def vocabulary_refusal(model: str, pre: str | None) -> str | None:
    """refusal() from the two metadata values it depends on (tokenizer.ggml.model and .pre): the plan's check."""
    if model == "llama" or model == "gemma4":
        return None
    if model == "gpt2":
        if pre in BPE_PRE:
            return None
        return (f"tokenizer.ggml.pre {pre!r}: llama.cpp splits this byte-level BPE vocabulary's text in a way "
                "qbuild does not rebuild (qbuild.models.gguf_tokenizer.BPE_PRE lists the pre-tokenizers it does)")
    why = REFUSED_MODELS.get(model, "a vocabulary type qbuild does not rebuild")
    return f"tokenizer.ggml.model {model!r}: {why}"


def write_tokenizer(gguf_path: Path, out: Path) -> str:
    """Write `out`'s tokenizer files from the GGUF's vocabulary; says what was written. Raises TokenizerRefused (one
    line) for a vocabulary whose tokenization it cannot make llama.cpp's."""
    vocab = read_vocab(gguf_path)
    why = refusal(vocab)
    if why is not None:
        raise TokenizerRefused(why)
    if vocab.model == "llama":
        write_sentencepiece(vocab, out)
        return "SentencePiece (tokenizer.model from the GGUF's pieces, scores and types; merges by score)"
    if vocab.model == "gemma4":
        write_gemma4(vocab, out)
        return "Gemma 4 BPE (spaces as ▁, split at newlines, byte fallback)"
    return write_byte_level_bpe(vocab, out)


def sentencepiece_proto(vocab: GGUFVocab):
    """sentencepiece's ModelProto of a GGUF `llama` vocabulary: a BPE model (llama.cpp's SPM tokenizer merges the
    pair whose merged piece scores highest, which is SentencePiece's BPE), with byte fallback when the vocabulary
    has byte pieces, no normalization, and the dummy prefix the GGUF declares (Gemma: none)."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    if vocab.scores is None:
        raise ValueError("the GGUF's SentencePiece vocabulary has no tokenizer.ggml.scores")
    proto = pb.ModelProto()
    for piece, score, kind in zip(vocab.tokens, vocab.scores, vocab.types, strict=True):
        p = proto.pieces.add()
        p.piece, p.score = piece, float(score)
        p.type = kind if kind in (NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE) else NORMAL
    spec = proto.trainer_spec
    spec.model_type = pb.TrainerSpec.BPE
    spec.vocab_size = len(vocab.tokens)
    spec.byte_fallback = BYTE in vocab.types
    unk = _unk_id(vocab)
    if unk is None:
        raise ValueError("the GGUF's SentencePiece vocabulary has no unknown token (sentencepiece needs one)")
    proto.pieces[unk].type = UNKNOWN
    for kind in ("unk", "bos", "eos", "pad"):
        i = unk if kind == "unk" else vocab.special.get(kind, -1)
        setattr(spec, f"{kind}_id", i)
        if i >= 0:
            setattr(spec, f"{kind}_piece", vocab.tokens[i])
    if spec.pad_id in (spec.bos_id, spec.eos_id, spec.unk_id):   # sentencepiece wants distinct ids: pad shares one
        spec.pad_id = -1
    norm = proto.normalizer_spec
    norm.name = "identity"
    norm.add_dummy_prefix = _space_prefix(vocab)
    norm.remove_extra_whitespaces = False
    norm.escape_whitespaces = True
    return proto


def _unk_id(vocab: GGUFVocab) -> int | None:
    return vocab.special.get("unk", next((i for i, t in enumerate(vocab.types) if t == UNKNOWN), None))


def _space_prefix(vocab: GGUFVocab) -> bool:
    """llama.cpp's add_space_prefix: the GGUF's, true for SentencePiece where it says nothing."""
    return True if vocab.add_space_prefix is None else bool(vocab.add_space_prefix)


def _special_kwargs(vocab: GGUFVocab) -> dict:
    kwargs = {f"{kind}_token": vocab.token(kind) for kind in ("bos", "eos", "unk", "pad") if vocab.token(kind)}
    kwargs["add_bos_token"], kwargs["add_eos_token"] = vocab.add_bos, vocab.add_eos
    if vocab.chat_template:
        kwargs["chat_template"] = vocab.chat_template
    return kwargs


def _added_tokens(vocab: GGUFVocab) -> list:
    """Control tokens as special added tokens, user-defined ones as plain added tokens: matched whole in text, as
    llama.cpp's tokenizer matches them; with the whitespace llama.cpp strips after them where it does: for a GGUF
    whose general.name says Phi-3, llama.cpp (llama-vocab.cpp) sets RSTRIP on its special tokens but <unk>, <s> and
    <|endoftext|>, and on </s>."""
    from tokenizers import AddedToken

    name = vocab.name.lower()
    phi3 = "phi-3" in name or "phi3" in name
    kept = {"<unk>", "<s>", "<|endoftext|>"}
    return [AddedToken(tok, special=kind == CONTROL, normalized=False, **({"rstrip": True} if phi3 and tok not in kept
                                                                           else {}))
            for tok, kind in zip(vocab.tokens, vocab.types, strict=True) if kind in (CONTROL, USER_DEFINED)]


def spm_merges(vocab: GGUFVocab) -> list[tuple[str, str]]:
    """Every pair of tokens whose concatenation is a token, ranked as llama.cpp's SPM tokenizer merges: the merged
    piece's score, highest first. Among equal scores (Llama's runs of ▁ all score -1e9) llama.cpp merges the
    leftmost pair; a longer left piece ranked first reproduces that for a run growing from its left."""
    ids = {t: i for i, t in enumerate(vocab.tokens)}
    scores = vocab.scores
    ranked = []
    for token, i in ids.items():
        for k in range(1, len(token)):
            left, right = token[:k], token[k:]
            if left in ids and right in ids:
                ranked.append((-scores[i], -k, i, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _post_processor(vocab: GGUFVocab):
    """BOS/EOS around a sequence as the GGUF's add_bos/add_eos say."""
    from tokenizers import processors

    bos = vocab.token("bos") if vocab.add_bos else None
    eos = vocab.token("eos") if vocab.add_eos else None
    single = " ".join(s for s in (bos and f"{bos}:0", "$A:0", eos and f"{eos}:0") if s)
    pair = " ".join(s for s in (single, bos and f"{bos}:1", "$B:1", eos and f"{eos}:1") if s)
    specials = [(t, vocab.special[k]) for t, k in ((bos, "bos"), (eos, "eos")) if t]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=list(dict.fromkeys(specials)))


def write_sentencepiece(vocab: GGUFVocab, out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, normalizers

    proto = sentencepiece_proto(vocab)
    (out / "tokenizer.model").write_bytes(proto.SerializeToString())   # llama.cpp's converter reads this one
    prefix = _space_prefix(vocab)
    unk = _unk_id(vocab)
    bpe = models.BPE(vocab={t: i for i, t in enumerate(vocab.tokens)}, merges=spm_merges(vocab),
                     unk_token=vocab.tokens[unk] if unk is not None else None, fuse_unk=True,
                     byte_fallback=BYTE in vocab.types)
    tokenizer = Tokenizer(bpe)
    # llama.cpp: ' ' → '▁' and, with a space prefix, one '▁' before the text (each run of text between special
    # tokens): then SPM merges over the whole of it, no pre-tokenizer
    escape = normalizers.Replace(" ", "▁")
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), escape]) if prefix else escape
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tokenizer.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    tokenizer.post_processor = _post_processor(vocab)
    _save_fast(vocab, tokenizer, _added_tokens(vocab), out)


def write_gemma4(vocab: GGUFVocab, out: Path) -> None:
    """llama.cpp's Gemma 4 BPE (llm_tokenizer_bpe, pre-type gemma4): spaces as ▁ (no prefix), the text split into
    runs of newlines and of the rest, the GGUF's merges on UTF-8 characters, bytes as <0xXX> tokens where a piece is
    no token."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    if vocab.merges is None:
        raise ValueError("the GGUF's Gemma 4 vocabulary has no tokenizer.ggml.merges")
    merges = [tuple(m.split(" ", 1)) for m in vocab.merges]
    bpe = models.BPE(vocab={t: i for i, t in enumerate(vocab.tokens)}, merges=merges, byte_fallback=True)
    tokenizer = Tokenizer(bpe)
    tokenizer.normalizer = normalizers.Replace(" ", "▁")
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^\n]+|[\n]+"), behavior="isolated")
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tokenizer.post_processor = _post_processor(vocab)
    _save_fast(vocab, tokenizer, _added_tokens(vocab), out)


def _save_fast(vocab: GGUFVocab, tokenizer, added: list, out: Path) -> None:
    """Save a `tokenizers` pipeline as tokenizer.json + tokenizer_config.json, for transformers' generic fast class:
    a model-specific class (LlamaTokenizer, GemmaTokenizer) rebuilds its own normalizer and pre-tokenizer on load
    and would undo the pipeline; transformers 5 writes `TokenizersBackend`, a class transformers 4 (in serving
    engines) does not have, and the generic class reads tokenizer.json as it is in both."""
    from transformers import PreTrainedTokenizerFast

    # through the file: transformers deep-copies a tokenizer object it is given (2.4 s for a 262k vocabulary)
    tokenizer.save(str(out / "tokenizer.json"))
    fast = PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json"), **_special_kwargs(vocab))
    fast.add_tokens(added)
    fast.save_pretrained(str(out))
    # add_bos/add_eos are written out even where they are the class's default, for readers (llama.cpp's converter)
    # that do not know the default
    _edit_config(out, tokenizer_class="PreTrainedTokenizerFast", **_bos_eos(vocab))


def write_byte_level_bpe(vocab: GGUFVocab, out: Path) -> str:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    if vocab.merges is None:
        raise ValueError("the GGUF's byte-level BPE vocabulary has no tokenizer.ggml.merges")
    pre = BPE_PRE[vocab.pre]
    merges = [tuple(m.split(" ", 1)) for m in vocab.merges]
    bpe = models.BPE(vocab={t: i for i, t in enumerate(vocab.tokens)}, merges=merges,
                     ignore_merges=pre.ignore_merges)
    tokenizer = Tokenizer(bpe)
    steps = []
    for regex in pre.split:
        if regex is _DIGIT:
            steps.append(pre_tokenizers.Digits(individual_digits=True))
        elif regex is not _GPT2_REGEX:
            steps.append(pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False))
    gpt2 = _GPT2_REGEX in pre.split      # ByteLevel's own regex: GPT-2's split, as the last one
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=gpt2))
    tokenizer.pre_tokenizer = steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    _save_fast(vocab, tokenizer, _added_tokens(vocab), out)
    return f"byte-level BPE, pre-tokenizer {vocab.pre!r}"


def _bos_eos(vocab: GGUFVocab) -> dict:
    return {"add_bos_token": vocab.add_bos, "add_eos_token": vocab.add_eos}


def _edit_config(out: Path, **changes) -> None:
    """Set (None: remove) keys of out/tokenizer_config.json."""
    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")
