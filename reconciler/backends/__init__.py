"""Kernel backends: each renders the DesiredState into its kernel model, observes the kernel into the
same model, plans the operations between the two and applies them atomically."""
