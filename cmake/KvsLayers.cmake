# The build side of the layering (cmake/layers.cmake holds the table). Each layer folder's headers
# are staged, as symbolic links, in a folder of their own (<build>/layers/<id>/<folder>/), and a
# layer's target gets include paths to its own staged folder and to those of the folders the
# table allows, never the repository root. A header of any other folder is then simply not found:
# `#include "service/pool.h"` in cache/ fails to compile. The links follow the sources (an edit is
# seen at once); adding or removing a header re-runs CMake through CONFIGURE_DEPENDS.
include(${PROJECT_SOURCE_DIR}/cmake/layers.cmake)
set(KVS_LAYER_INCLUDE_ROOT ${PROJECT_BINARY_DIR}/layers)

function(kvs_layer_include_dir folder out)
  string(REPLACE "/" "_" id "${folder}")
  set(${out} ${KVS_LAYER_INCLUDE_ROOT}/${id} PARENT_SCOPE)
endfunction()

# Links the headers of <folder> and of its sub-folders that are not layers of their own
# (storage/redis/ belongs to storage; gpu/cpu/ is a layer) into its staged include folder,
# dropping links to headers that are gone.
function(kvs_stage_layer folder)
  kvs_layer_include_dir(${folder} root)
  set(source ${PROJECT_SOURCE_DIR}/${folder})
  set(staged ${root}/${folder})
  file(GLOB_RECURSE found CONFIGURE_DEPENDS RELATIVE ${source} ${source}/*.h ${source}/*.cuh)
  set(headers "")
  foreach(name IN LISTS found)
    set(own TRUE)
    foreach(layer IN LISTS KVS_LAYERS)
      string(FIND "${folder}/${name}" "${layer}/" at)
      if(at EQUAL 0 AND NOT layer STREQUAL folder)
        string(LENGTH "${layer}" layer_length)
        string(LENGTH "${folder}" folder_length)
        if(layer_length GREATER folder_length)
          set(own FALSE)  # in a deeper layer folder
        endif()
      endif()
    endforeach()
    if(own)
      list(APPEND headers ${name})
    endif()
  endforeach()
  file(MAKE_DIRECTORY ${staged})
  file(GLOB_RECURSE present RELATIVE ${staged} LIST_DIRECTORIES false ${staged}/*)
  foreach(name IN LISTS present)
    if(IS_SYMLINK ${staged}/${name} AND NOT name IN_LIST headers)
      file(REMOVE ${staged}/${name})
    endif()
  endforeach()
  foreach(name IN LISTS headers)
    if(NOT IS_SYMLINK ${staged}/${name})
      get_filename_component(dir ${staged}/${name} DIRECTORY)
      file(MAKE_DIRECTORY ${dir})
      file(CREATE_LINK ${source}/${name} ${staged}/${name} SYMBOLIC)
    endif()
  endforeach()
endfunction()

foreach(layer IN LISTS KVS_LAYERS)
  if(NOT layer STREQUAL "proto")  # generated headers: kvs_proto's own include folder
    kvs_stage_layer(${layer})
  endif()
endforeach()

# kvs_layer_target(<target> <folder>): <target> holds code of layer <folder>: it sees that folder's
# headers and those of the folders the table allows (proto through linking kvs_proto), and builds
# with the project's warnings. kvs_check_layer_links() later holds its links to the same table.
function(kvs_layer_target target folder)
  if(NOT folder IN_LIST KVS_LAYERS)
    message(FATAL_ERROR
      "kvs_layer_target(${target}): ${folder} is not a layer in cmake/layers.cmake")
  endif()
  kvs_layer_include_dir(${folder} own)
  set(dirs ${own})
  foreach(dep IN LISTS KVS_LAYER_DEPS_${folder})
    if(NOT dep STREQUAL "proto")
      kvs_layer_include_dir(${dep} dir)
      list(APPEND dirs ${dir})
    endif()
  endforeach()
  target_include_directories(${target} PRIVATE ${dirs})
  target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:${KVS_WARNINGS}>)
  set_property(TARGET ${target} PROPERTY KVS_LAYER ${folder})
  set_property(GLOBAL APPEND PROPERTY KVS_LAYER_TARGETS ${target})
endfunction()

# Fails the configuration when a layer target links a project library of a folder its own folder
# may not depend on (kvs_proto counts as the proto layer).
function(kvs_check_layer_links)
  set_property(TARGET kvs_proto PROPERTY KVS_LAYER proto)
  get_property(targets GLOBAL PROPERTY KVS_LAYER_TARGETS)
  foreach(target IN LISTS targets)
    get_target_property(folder ${target} KVS_LAYER)
    get_target_property(links ${target} LINK_LIBRARIES)
    get_target_property(interface_links ${target} INTERFACE_LINK_LIBRARIES)
    foreach(link IN LISTS links interface_links)
      if(NOT TARGET "${link}")
        continue()
      endif()
      get_target_property(aliased ${link} ALIASED_TARGET)
      if(aliased)
        set(link ${aliased})
      endif()
      get_target_property(dep ${link} KVS_LAYER)
      if(dep AND NOT dep STREQUAL folder AND NOT dep IN_LIST KVS_LAYER_DEPS_${folder})
        message(FATAL_ERROR "${target} (${folder}) links ${link} (${dep}): ${folder} -> ${dep} "
                            "is not an allowed direction in cmake/layers.cmake")
      endif()
    endforeach()
  endforeach()
endfunction()
