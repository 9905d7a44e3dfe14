"""spawnllm 0.17.1's own OpenAiEndpointBackend against mlx-serve, with a
pydantic response model: spawnllm sends a strict json_schema
response_format and validates the answer into the model. Usage:
spawnllm_structured.py BASE_URL MODEL; prints "ok N" and exits 0."""

import sys
from typing import Literal

from pydantic import BaseModel, Field
from spawnllm.backends.openai_endpoint import OpenAiEndpointBackend
from spawnllm.spec import RunSpec

base_url, model = sys.argv[1], sys.argv[2]


class Review(BaseModel):
    rating: int = Field(ge=1, le=5)
    sentiment: Literal["positive", "negative", "mixed"]
    keywords: list[str] = Field(max_length=3)


backend = OpenAiEndpointBackend(base_url + "/v1", model)
reviews = [
    "Great blender, crushed ice in seconds.",
    "Broke after two days. Never again.",
    "It is fine, nothing special.",
    "The lid leaks but the motor is strong.",
]
for text in reviews:
    response = backend.execute(
        RunSpec(prompt=f"Review: {text}", model=model, response_model=Review, max_attempts=1)
    )
    assert response.error is None, response.error
    parsed = response.result.parsed
    assert isinstance(parsed, Review), response
    print(text, "->", parsed.model_dump_json(), file=sys.stderr)

print("ok", len(reviews))
