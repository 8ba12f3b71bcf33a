"""The media step: buffers, the verdict cache, the model's geometry and tokens, and the step itself."""
