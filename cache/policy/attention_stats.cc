#include "cache/policy/attention_stats.h"
