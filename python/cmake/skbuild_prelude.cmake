# Included by project() in wheel builds (pyproject.toml sets
# CMAKE_PROJECT_kernscope_INCLUDE to this file), before the top-level
# CMakeLists.txt looks for dlpack/dlpack.h. A fresh machine may lack
# libdlpack-dev: then the minimal header in python/cmake/dlpack_min is used.
find_path(DLPACK_INCLUDE_DIR dlpack/dlpack.h
  HINTS ${KS_DLPACK_INCLUDE_DIR} ${CMAKE_SOURCE_DIR}/.dlpack/usr/include)
if(NOT DLPACK_INCLUDE_DIR)
  message(STATUS "kernscope: no dlpack/dlpack.h found; using python/cmake/dlpack_min")
  set(DLPACK_INCLUDE_DIR "${CMAKE_CURRENT_LIST_DIR}/dlpack_min" CACHE PATH "dlpack/dlpack.h include dir" FORCE)
endif()
