"""Per-request sampling parameters, validated the same way for the Python API, the CLI and the HTTP server."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from confkv.config import SEED_RANGE, format_validation_error
from confkv.errors import ConfkvError

#: Temperatures below this are greedy (as in vLLM): dividing logits by a smaller one overflows float32.
SAMPLING_EPS = 1e-5


class SamplingParams(BaseModel):
    """How one request is decoded. ``temperature = 0`` is greedy (the default, as in Hugging Face ``generate``), and
    so is any temperature below ``SAMPLING_EPS``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_tokens: int = Field(16, ge=1, description="tokens to generate at most")
    temperature: float = Field(0.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, description="0 disables top-k")
    seed: int | None = Field(
        None,
        ge=SEED_RANGE[0],
        le=SEED_RANGE[1],
        description="per-request sampling seed; default derived from the engine seed",
    )
    stop: list[str] = Field(default_factory=list, description="strings that end the output (not included)")
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = Field(
        None, ge=0, le=20, description="return each generated token's log-probability and this many top alternatives"
    )

    def __init__(self, **data: object) -> None:
        try:
            super().__init__(**data)
        except ValidationError as err:
            loc = err.errors()[0]["loc"] if err.errors() else ()
            raise ConfkvError(format_validation_error(err, "sampling parameter"),
                              param=str(loc[0]) if loc else None) from None  # fmt: skip

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, stop: list[str]) -> list[str]:
        if any(s == "" for s in stop):
            raise ValueError("stop strings must not be empty")
        return stop

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS
