// megaloop/tiles.cuh: the tile templates the generated tile functions instantiate (emit*.py).
#pragma once
#include "megaloop/elementwise.cuh"
#include "megaloop/attention_grad.cuh"
#include "megaloop/cache.cuh"
#include "megaloop/gather.cuh"
#include "megaloop/loss.cuh"
#include "megaloop/matvec.cuh"
#include "megaloop/paged.cuh"
#include "megaloop/rows.cuh"
#include "megaloop/reduce.cuh"
#include "megaloop/rope.cuh"
#include "megaloop/optim.cuh"
#include "megaloop/optim_norm.cuh"
