#pragma once

// Everything a user of the library needs.
#include "flashattn/attention.hpp"
#include "flashattn/backward.hpp"
#include "flashattn/error.hpp"
#include "flashattn/introspect.hpp"
#include "flashattn/kvcache.hpp"
#include "flashattn/merge.hpp"
#include "flashattn/mha.hpp"
#include "flashattn/options.hpp"
#include "flashattn/tensor.hpp"
#include "flashattn/varlen.hpp"
#include "flashattn/version.hpp"
