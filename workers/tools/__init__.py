"""Tool calling on our own engine: render tools into the prompt, parse calls out of the text."""
