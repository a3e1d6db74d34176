"""TileLang templates: each module's builder turns constexprs into a T.prim_func (TileLang reads its source back)."""
