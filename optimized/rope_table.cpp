#include "optimized/rope_table.h"
