// cubin_syms.h: whether a cubin (an ELF image, as NVRTC writes it) defines a function of a given name:
// its symbol table lists the kernels compiled into it. For C and C++ tests alike.
#ifndef MDL_CUBIN_SYMS_H
#define MDL_CUBIN_SYMS_H
#include <elf.h>
#include <stdbool.h>
#include <string.h>

static inline bool cubin_has_function(const void *image, const char *name) {
  const unsigned char *p = (const unsigned char *)image;
  const Elf64_Ehdr *eh = (const Elf64_Ehdr *)image;
  if (memcmp(p, ELFMAG, SELFMAG) || p[EI_CLASS] != ELFCLASS64 || eh->e_shentsize != sizeof(Elf64_Shdr))
    return false;
  const Elf64_Shdr *sh = (const Elf64_Shdr *)(p + eh->e_shoff);
  for (int s = 0; s < eh->e_shnum; s++) {
    if (sh[s].sh_type != SHT_SYMTAB || sh[s].sh_link >= eh->e_shnum || !sh[s].sh_entsize)
      continue;
    const Elf64_Sym *sym = (const Elf64_Sym *)(p + sh[s].sh_offset);
    const char *names = (const char *)(p + sh[sh[s].sh_link].sh_offset);
    for (size_t i = 0; i < sh[s].sh_size / sh[s].sh_entsize; i++)
      if (ELF64_ST_TYPE(sym[i].st_info) == STT_FUNC && sym[i].st_shndx != SHN_UNDEF &&
          !strcmp(names + sym[i].st_name, name))
        return true;
  }
  return false;
}
#endif
