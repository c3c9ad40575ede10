"""The tools recipe: a policy that learns to use the calculator tool over two turns."""
