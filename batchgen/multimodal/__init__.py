"""Images in, text out: the image side of a request for vision-language models.

One seam per room, nothing spread through the engine: `families` says from the config which
families are served and what each needs; `inputs` reads the user's images; `prompt` runs the
model's HF processor at request build (`ImagePrompts` -> `MMPrompt`, in `items`); `encoder`
runs the model's own `get_image_features` with a cache; `step` is the runner's seam
(`VisionStep`: positions, features scattered into the step's embeddings); `processor` loads
the processor without torchvision. This module imports nothing (the engine's floors import
`items` alone)."""
