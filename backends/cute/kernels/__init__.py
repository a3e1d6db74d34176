"""CuTe DSL templates: each module's builder returns the @cute.jit host function and the fake tensors to compile
it on (the DSL reads its source back, so templates live in files)."""
