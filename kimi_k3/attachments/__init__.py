"""How training code acts on a Kimi K3 model from outside: the model's seams, found in one place, the padding mask
shared by every recorder, and handles whose ``remove()`` restores the plain model."""
