"""Small example models and the demo (``python -m harpjax.examples.demo``)."""
